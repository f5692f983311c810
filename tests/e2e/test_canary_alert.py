"""A memory alert on a canary pod takes the canary back, with real parts only.

The operator runs as a subprocess on the local control plane (KWOK GPU nodes); a policy change
of a two-replica server starts one canary pod. Allocator series that say 87.5% of the reserved
memory is unused (what a fragmented caching allocator reports) are served by a plain HTTP
exporter and scraped by a real Prometheus as that canary pod's, with the operator's rendered
rules loaded; a real Alertmanager posts the fragmentation alert to the operator's webhook. The
remediation records it for the canary pod, the canary fails on `fragmentation`, its Deployment
is deleted and the stable replicas, never replaced, run the old template.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import (
    OperatorProcess,
    get_server,
    install_crd,
    llmserver,
    restrict_namespace,
    rules_file,
    server_events,
    server_pods,
    wait_beside_canary,
    wait_ready_pods,
)
from harness.processes import exporter as static_exporter
from harness.processes import start_alertmanager
from harness.prometheus import Prometheus, pod_scrape

GiB = 1 << 30
# What the engine exports on a GPU whose allocator holds 8 GiB, 1 GiB of it in use.
FRAGMENTED = {
    'pagekeeper_allocator_reserved_bytes{model_name="m"}': 8.0 * GiB,
    'pagekeeper_allocator_allocated_bytes{model_name="m"}': 1.0 * GiB,
}
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 2,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
    "remediation": {
        "hysteresisSeconds": 2,
        "triggers": {
            "fragmentation": {"threshold": 0.5, "minBytes": "1Gi", "for": "2s"},
            "kvCacheSaturation": {"enabled": False},
            "queueBacklog": {"enabled": False},
            "engineStalled": {"enabled": False},
        },
    },
}


def test_a_fragmentation_alert_on_the_canary_pod_fails_the_canary(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    with contextlib.ExitStack() as stack:
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver("frag", SPEC)], "-n", namespace)
        stable = set(wait_ready_pods(cluster, namespace, "frag", 2))
        old_template = apps.read_namespaced_deployment("frag", namespace).spec.template

        changed = copy.deepcopy(SPEC)
        changed["memoryPolicy"]["gpuMemoryUtilization"] = 0.85
        cluster.apply_yaml([llmserver("frag", changed)], "-n", namespace)

        def canary_pod() -> str | None:
            pods = server_pods(cluster, namespace, "frag")
            ready = [
                p.metadata.name
                for p in pods
                if (p.metadata.labels or {}).get("pagekeeper.dev/canary") == "true"
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            ]
            return ready[0] if ready else None

        canary = wait_for(canary_pod, timeout=120, what="a ready canary pod")
        survivors = wait_beside_canary(cluster, namespace, "frag", canary, 1)

        exporter, _ = stack.enter_context(static_exporter(FRAGMENTED))
        rules = rules_file(cluster, namespace, "frag", tmp_path / "rules.yml")
        alertmanager = start_alertmanager(
            tmp_path / "alertmanager", operator.webhook_url, operator.token
        )
        stack.callback(alertmanager.stop)
        prometheus = Prometheus(tmp_path / "prometheus", [rules], alertmanager)
        stack.callback(prometheus.stop)
        prometheus.start([pod_scrape(exporter, (namespace, canary, "frag"), job="allocator")])

        def failed() -> dict[str, Any] | None:
            """The outcome is recorded before the Deployments move, the Event and conditions
            after them: wait for the condition too."""
            status = get_server(cluster, namespace, "frag").get("status", {})
            record = status.get("canary") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            done = record.get("phase") == "Failed" and conditions.get("CanaryFailed") == "True"
            return status if done else None

        try:
            status = wait_for(failed, timeout=120, what="the canary failed")
        except AssertionError:
            print(operator.log_tail(8000))
            print(alertmanager.log.read_text(errors="replace")[-3000:])
            raise

    record = status["canary"]
    assert record["failedSignal"] == "fragmentation"
    assert record["message"] == (
        f"fragmentation: PagekeeperFragmentationHigh fired for canary pod {canary}"
    )
    assert any(
        e.reason == "CanaryFailed" and e.message == record["message"]
        for e in server_events(cluster, namespace, "frag")
    )
    wait_for(
        lambda: (
            not any(
                d.metadata.name == "frag-canary"
                for d in apps.list_namespaced_deployment(namespace).items
            )
        ),
        what="the canary Deployment deleted",
    )
    main = apps.read_namespaced_deployment("frag", namespace)
    assert main.spec.template.metadata.annotations == old_template.metadata.annotations
    assert main.spec.replicas == 2
    remaining = {p.metadata.name for p in server_pods(cluster, namespace, "frag")}
    assert survivors <= remaining and survivors <= stable  # the stable replicas never changed
