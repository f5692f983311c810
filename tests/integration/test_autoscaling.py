"""spec.autoscaling on the real control plane, with kube-controller-manager's own
HorizontalPodAutoscaler controller running and the operator as a subprocess.

No custom-metrics API is registered here (the e2e test has one), so the controller only holds
the count within minReplicas..maxReplicas; the test plays the autoscaler's writes through the
Deployment's scale subresource, as the controller makes them. The operator must hand the count
over without a single pod lost, never write it back, keep its PodDisruptionBudget, remediation
and canaries working on the autoscaled count, and render a KEDA ScaledObject, valid under KEDA's
published schema, where KEDA is installed.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import OperatorProcess as WebhookOperator
from harness.loop import llmserver, restrict_namespace, wait_history
from harness.operator_process import OperatorProcess
from harness.tools import CACHE, missing
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import ClusterFeatures, render_autoscaler
from pagekeeper_operator.rollout.autoscaling import HANDOVER_MANAGER
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_or_none,
    get_server,
    wait_quiet,
    wait_ready,
)

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

KEDA_CRDS = sorted(CACHE.glob("crds/keda-*/keda.sh_scaledobjects.yaml"))
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b"},
    "replicas": 2,
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4}


def with_autoscaling(spec: dict[str, Any], **autoscaling: Any) -> dict[str, Any]:
    return {**spec, "autoscaling": {**AUTOSCALING, **autoscaling}}


def scale(cluster: Cluster, namespace: str, name: str, replicas: int) -> None:
    """What the HorizontalPodAutoscaler controller does: write the scale subresource."""
    cluster.kubectl("scale", "deployment", name, "-n", namespace, f"--replicas={replicas}")


def replicas_owners(deployment: Any) -> set[str]:
    """The field managers that own spec.replicas of a Deployment."""
    return {
        entry.manager
        for entry in deployment.metadata.managed_fields or []
        if "f:replicas" in ((entry.fields_v1 or {}).get("f:spec") or {})
    }


def pod_uids(cluster: Cluster, namespace: str, name: str) -> set[str]:
    """The uids of the server's pods that are not going away."""
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
        namespace, label_selector=f"pagekeeper.dev/llmserver={name}"
    )
    return {p.metadata.uid for p in pods.items if p.metadata.deletion_timestamp is None}


def printed_row(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    columns = "CURRENT:.status.replicas,DESIRED:.status.desiredReplicas"
    out = cluster.kubectl("get", "llms", name, "-n", namespace, "-o", f"custom-columns={columns}")
    header, row = out.stdout.strip().splitlines()
    return dict(zip(header.split(), row.split(), strict=True))


def test_the_autoscaler_owns_the_count_and_the_operator_never_writes_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apps = client.AppsV1Api(cluster.api)
    hpas = client.AutoscalingV2Api(cluster.api)
    apply_server(cluster, namespace, llmserver("m", SPEC))
    wait_ready(cluster, namespace, "m", 2)
    before = apps.read_namespaced_deployment("m", namespace)
    assert replicas_owners(before) == {"pagekeeper-operator"}
    uids = pod_uids(cluster, namespace, "m")

    # Autoscaling on: the count is handed over, not reset to the API server's default of 1.
    apply_server(cluster, namespace, llmserver("m", with_autoscaling(SPEC)))
    hpa = wait_for(
        lambda: get_or_none(hpas.read_namespaced_horizontal_pod_autoscaler, "m", namespace),
        what="the HorizontalPodAutoscaler",
    )
    server = LLMServer.from_body(get_server(cluster, namespace, "m"))
    rendered = render_autoscaler(server, ClusterFeatures())
    assert rendered is not None
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 4)
    assert [m.pods.metric.name for m in hpa.spec.metrics] == [
        "vllm_kv_cache_usage_perc",
        "vllm_num_requests_waiting",
    ]
    assert hpa.spec.scale_target_ref.name == "m"
    handed = wait_for(
        lambda: (
            (d := apps.read_namespaced_deployment("m", namespace))
            and "pagekeeper-operator" not in replicas_owners(d)
            and d
        ),
        what="spec.replicas no longer the operator's",
    )
    assert replicas_owners(handed) == {HANDOVER_MANAGER}
    assert handed.spec.replicas == 2
    # A count reset to 1 would have deleted a pod, and nothing would have made it again (1 is
    # within the autoscaler's bounds).
    assert pod_uids(cluster, namespace, "m") == uids
    assert "handed Deployment/m replicas (2) to the autoscaler" in operator.log()

    # The autoscaler's writes stand: the resyncs that follow write nothing at all.
    scale(cluster, namespace, "m", 3)
    wait_ready(cluster, namespace, "m", 3)
    version = wait_quiet(
        lambda: apps.read_namespaced_deployment("m", namespace).metadata.resource_version,
        seconds=3 * operator.resync_seconds,
        timeout=120,
    )
    assert apps.read_namespaced_deployment("m", namespace).metadata.resource_version == version
    assert printed_row(cluster, namespace, "m") == {"CURRENT": "3", "DESIRED": "3"}
    assert operator.log().count("applied Deployment/m (changed)") == 1  # the autoscaling spec

    # The HorizontalPodAutoscaler controller itself holds the count within maxReplicas.
    scale(cluster, namespace, "m", 6)
    wait_for(
        lambda: apps.read_namespaced_deployment("m", namespace).spec.replicas == 4,
        timeout=90,
        what="the controller bringing the Deployment back to maxReplicas",
    )
    wait_ready(cluster, namespace, "m", 4)

    def recorded() -> Any:
        scaled = (get_server(cluster, namespace, "m").get("status") or {}).get("autoscaling")
        return scaled if scaled and scaled.get("lastScaleReason") else None

    status = wait_for(recorded, timeout=60, what="status.autoscaling with a last scale")
    assert status["kind"] == "HorizontalPodAutoscaler" and status["name"] == "m"
    assert status["lastScaleReason"] == "down 6->4 (held at maxReplicas)"
    assert status["desiredReplicas"] == 4

    # Autoscaling off: spec.replicas again, and the HorizontalPodAutoscaler goes.
    apply_server(cluster, namespace, llmserver("m", SPEC))
    wait_ready(cluster, namespace, "m", 2)
    wait_for(
        lambda: get_or_none(hpas.read_namespaced_horizontal_pod_autoscaler, "m", namespace) is None,
        what="the HorizontalPodAutoscaler deleted",
    )
    assert "autoscaling" not in get_server(cluster, namespace, "m")["status"]


def _alert(namespace: str, pod: str, server: str) -> dict[str, Any]:
    labels = {
        "alertname": "PagekeeperKVCacheSaturated",
        "namespace": namespace,
        "pod": pod,
        "llmserver": server,
        "pagekeeper_remediate": "true",
    }
    started = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    alert = {
        "status": "firing",
        "labels": labels,
        "startsAt": started,
        "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": uuid.uuid4().hex[:16],
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{pod="{pod}"}}',
        "status": "firing",
        "receiver": "pagekeeper",
        "groupLabels": {"pod": pod},
        "commonLabels": labels,
        "alerts": [alert],
    }


def _post(url: str, token: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


def test_budget_and_remediation_count_the_autoscaled_pods(
    cluster: Cluster, namespace: str, llmserver_crd: Path, tmp_path: Path
) -> None:
    """spec.replicas says 5, the autoscaler keeps 2: the budget expects 2 pods, and an alert
    on one of them evicts it (counted against 5, two pods would look like three missing)."""
    restrict_namespace(cluster, namespace)
    process = WebhookOperator(cluster.kubeconfig, namespace, tmp_path / "operator")
    try:
        process.wait_ready()
        remediation = {"hysteresisSeconds": 0, "cooldownSeconds": 600, "maxUnavailable": 1}
        spec = with_autoscaling({**SPEC, "replicas": 5, "remediation": remediation})
        apply_server(cluster, namespace, llmserver("m", spec))
        wait_for(
            lambda: get_or_none(
                client.AppsV1Api(cluster.api).read_namespaced_deployment, "m", namespace
            ),
            what="the Deployment",
        )
        scale(cluster, namespace, "m", 2)
        wait_ready(cluster, namespace, "m", 2)
        policy = client.PolicyV1Api(cluster.api)

        def budget() -> Any:
            status = policy.read_namespaced_pod_disruption_budget("m", namespace).status
            return status if status.expected_pods == 2 else None

        counted = wait_for(budget, what="the budget counting the 2 autoscaled pods")
        assert (counted.disruptions_allowed, counted.current_healthy) == (1, 2)
        pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
            namespace, label_selector="pagekeeper.dev/llmserver=m"
        )
        pod = sorted(p.metadata.name for p in pods.items)[0]
        assert _post(process.webhook_url, process.token, _alert(namespace, pod, "m")) == 200
        entry = wait_history(cluster, namespace, "m", 60, pod=pod, action="evict")
        assert entry["outcome"] == "evicted", entry
        wait_ready(cluster, namespace, "m", 2)
    finally:
        process.stop()


def test_a_canary_runs_beside_the_autoscaled_pods(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apps = client.AppsV1Api(cluster.api)
    canary = {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 5}}
    spec = with_autoscaling(
        {**SPEC, "memoryPolicy": {"gpuMemoryUtilization": 0.9}, "rollout": canary},
        minReplicas=2,
    )
    apply_server(cluster, namespace, llmserver("m", spec))
    # The Deployment starts at the API server's default of 1; the controller raises it to 2.
    wait_ready(cluster, namespace, "m", 2, timeout=90)
    scale(cluster, namespace, "m", 3)
    wait_ready(cluster, namespace, "m", 3)
    stable = apps.read_namespaced_deployment("m", namespace).spec.template

    changed = {**spec, "memoryPolicy": {"gpuMemoryUtilization": 0.85}}
    apply_server(cluster, namespace, llmserver("m", changed))

    def promoted() -> Any:
        status = get_server(cluster, namespace, "m").get("status") or {}
        return (status.get("canary") or {}).get("phase") == "Promoted" and status

    seen_canary = wait_for(
        lambda: get_or_none(apps.read_namespaced_deployment, "m-canary", namespace),
        what="the canary Deployment",
    )
    assert seen_canary.spec.replicas == 1
    main = apps.read_namespaced_deployment("m", namespace)
    assert main.spec.replicas == 3, "the canary comes beside the autoscaled pods"
    assert main.spec.template == stable
    wait_for(promoted, timeout=90, what="the canary promoted")
    wait_for(
        lambda: get_or_none(apps.read_namespaced_deployment, "m-canary", namespace) is None,
        what="the canary Deployment deleted",
    )
    main = apps.read_namespaced_deployment("m", namespace)
    assert main.spec.replicas == 3
    assert "--gpu-memory-utilization" in main.spec.template.spec.containers[0].command
    command = main.spec.template.spec.containers[0].command
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.85"


@pytest.fixture
def keda_crd(cluster: Cluster) -> Iterator[Path]:
    """KEDA's ScaledObject CRD, for one test: every other test runs on a cluster without it."""
    if not KEDA_CRDS:
        missing("KEDA's ScaledObject CRD (hack/provision.sh crds)")
    [path] = KEDA_CRDS
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.wait_established(SCALED_OBJECT_CRD)
    try:
        yield path
    finally:
        cluster.kubectl("delete", "-f", str(path), "--wait=true", "--timeout=120s")


def test_a_scaled_object_where_keda_is_installed(
    cluster: Cluster, namespace: str, llmserver_crd: Path, keda_crd: Path, tmp_path: Path
) -> None:
    prometheus = "http://prometheus-operated.monitoring.svc:9090"
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )  # fmt: skip
    process = OperatorProcess(
        cluster, namespace, tmp_path, extra_env={"PAGEKEEPER_PROMETHEUS_URL": prometheus}
    )
    process.start()
    try:
        apply_server(cluster, namespace, llmserver("m", with_autoscaling(SPEC)))
        custom = client.CustomObjectsApi(cluster.api)
        read = custom.get_namespaced_custom_object
        found = wait_for(
            lambda: get_or_none(read, "keda.sh", "v1alpha1", namespace, "scaledobjects", "m"),
            what="the ScaledObject",
        )
        server = LLMServer.from_body(get_server(cluster, namespace, "m"))
        features = ClusterFeatures(has_scaled_object=True, prometheus_url=prometheus)
        rendered = render_autoscaler(server, features)
        assert rendered is not None
        assert found["spec"] == rendered["spec"]
        hpas = client.AutoscalingV2Api(cluster.api)
        assert get_or_none(hpas.read_namespaced_horizontal_pod_autoscaler, "m", namespace) is None
        # KEDA's own schema refuses what it would refuse from anyone (its CEL rule here).
        bad = {**rendered, "metadata": {"name": "bad", "namespace": namespace}}
        bad["spec"] = {**rendered["spec"], "minReplicaCount": 5, "maxReplicaCount": 2}
        refused = cluster.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False
        )
        assert "minReplicaCount must be less than or equal to maxReplicaCount" in refused.stderr
    finally:
        process.stop()
