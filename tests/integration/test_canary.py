"""Canary rollouts on the real control plane with KWOK nodes and the operator running.

A policy change runs on one canary pod beside the others; an out-of-memory termination set on
it through the pod status subresource (as the kubelet would) takes it back, with status and an
Event naming the signal, while the other replicas never change; a clean analysis promotes the
change to every replica; an operator restarted mid-analysis resumes it.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver, wait_beside_canary
from harness.operator_process import OperatorProcess
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_or_none,
    get_server,
    wait_ready,
)

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

POLICY_HASH = "pagekeeper.dev/policy-hash"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "replicas": 3,
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxModelLen": 4096},
    "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
}


def changed(spec: dict[str, Any], utilization: float) -> dict[str, Any]:
    new = copy.deepcopy(spec)
    new["memoryPolicy"]["gpuMemoryUtilization"] = utilization
    return new


def wait_resyncs(operator: OperatorProcess, count: int) -> None:
    """Until `count` more resync rounds have finished in the operator's log."""
    done = "resync round done"
    target = operator.log().count(done) + count
    wait_for(lambda: operator.log().count(done) >= target, what=f"{count} resync rounds")


def canary_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_server(cluster, namespace, name).get("status", {})
    return status.get("canary") or {}


def template_hash(apps: client.AppsV1Api, namespace: str, name: str) -> str:
    deployment = apps.read_namespaced_deployment(name, namespace)
    return str(deployment.spec.template.metadata.annotations[POLICY_HASH])


def wait_analyzing(cluster: Cluster, namespace: str, name: str) -> Any:
    apps = client.AppsV1Api(cluster.api)

    def analyzing() -> Any:
        canary = get_or_none(apps.read_namespaced_deployment, f"{name}-canary", namespace)
        if canary_status(cluster, namespace, name).get("phase") != "Analyzing" or canary is None:
            return None
        main = apps.read_namespaced_deployment(name, namespace)
        return (
            canary if (canary.status.ready_replicas or 0) == 1 and main.spec.replicas == 2 else None
        )

    return wait_for(analyzing, timeout=120, what="one canary pod ready, two stable replicas")


def canary_pods(cluster: Cluster, namespace: str, name: str) -> list[Any]:
    selector = f"pagekeeper.dev/llmserver={name},pagekeeper.dev/canary=true"
    return list(
        client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector).items
    )


def stable_pods(cluster: Cluster, namespace: str, name: str) -> set[str]:
    selector = f"pagekeeper.dev/llmserver={name},!pagekeeper.dev/canary"
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector)
    return {p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None}


def test_an_oom_on_the_canary_takes_it_back_and_a_restart_resumes_the_analysis(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    apply_server(cluster, namespace, llmserver("qwen", SPEC))
    wait_ready(cluster, namespace, "qwen", 3)
    stable_hash = template_hash(apps, namespace, "qwen")

    apply_server(cluster, namespace, llmserver("qwen", changed(SPEC, 0.85)))
    canary = wait_analyzing(cluster, namespace, "qwen")
    assert canary.spec.template.metadata.annotations[POLICY_HASH] != stable_hash
    assert template_hash(apps, namespace, "qwen") == stable_hash  # the others keep theirs
    [canary_pod] = canary_pods(cluster, namespace, "qwen")
    survivors = wait_beside_canary(cluster, namespace, "qwen", canary_pod.metadata.name, 2)
    record = canary_status(cluster, namespace, "qwen")
    assert record["stableTemplateHash"] != record["templateHash"]

    # An operator restarted mid-analysis resumes it: same start, same canary Deployment.
    operator.stop()
    operator.start()
    wait_resyncs(operator, 2)
    assert canary_status(cluster, namespace, "qwen")["startedAt"] == record["startedAt"]
    resumed = apps.read_namespaced_deployment("qwen-canary", namespace)
    assert resumed.metadata.uid == canary.metadata.uid

    (pod,) = canary_pods(cluster, namespace, "qwen")
    terminated = {
        "reason": "OOMKilled",
        "exitCode": 137,
        "startedAt": "2026-11-23T10:00:00Z",
        "finishedAt": "2026-11-23T10:05:00Z",
    }
    statuses = [
        {**c.to_dict(), "restartCount": 1, "lastState": {"terminated": terminated}}
        for c in pod.status.container_statuses
    ]
    body = {"status": {"containerStatuses": [client.ApiClient().sanitize_for_serialization(
        {k: v for k, v in s.items() if v is not None}) for s in statuses]}}  # fmt: skip
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, body)

    def failed() -> dict[str, Any] | None:
        status = get_server(cluster, namespace, "qwen").get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        is_failed = conditions.get("CanaryFailed", {}).get("status") == "True"
        return status if is_failed and status.get("readyReplicas") == 3 else None

    status = wait_for(failed, timeout=120, what="CanaryFailed and three stable replicas")
    assert status["canary"]["phase"] == "Failed"
    assert status["canary"]["failedSignal"] == "oomEvents"
    assert "1 out-of-memory or stuck termination(s) of canary pods" in status["canary"]["message"]
    assert get_or_none(apps.read_namespaced_deployment, "qwen-canary", namespace) is None
    assert template_hash(apps, namespace, "qwen") == stable_hash
    assert survivors <= stable_pods(cluster, namespace, "qwen")  # never replaced
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=qwen").items
    assert any(
        e.reason == "CanaryFailed" and "oomEvents" in e.message and e.type == "Warning"
        for e in events
    )
    # The resync does not try the failed template again, and spec is never written.
    wait_resyncs(operator, 2)
    assert get_or_none(apps.read_namespaced_deployment, "qwen-canary", namespace) is None
    server = get_server(cluster, namespace, "qwen")
    assert server["spec"]["memoryPolicy"]["gpuMemoryUtilization"] == 0.85
    assert server["status"]["canary"]["phase"] == "Failed"


def test_a_clean_analysis_promotes_the_change_to_every_replica(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apps = client.AppsV1Api(cluster.api)
    spec = copy.deepcopy(SPEC)
    spec["rollout"]["canary"]["analysisSeconds"] = 5
    apply_server(cluster, namespace, llmserver("qwen", spec))
    wait_ready(cluster, namespace, "qwen", 3)
    stable_hash = template_hash(apps, namespace, "qwen")

    apply_server(cluster, namespace, llmserver("qwen", changed(spec, 0.85)))

    def promoted() -> dict[str, Any] | None:
        status = canary_status(cluster, namespace, "qwen")
        return status if status.get("phase") == "Promoted" else None

    record = wait_for(promoted, timeout=120, what="the canary promoted")
    assert "rolls to all 3 replicas" in record["message"]
    obj = wait_ready(cluster, namespace, "qwen", 3)
    assert obj["status"]["updatedReplicas"] == 3
    new_hash = template_hash(apps, namespace, "qwen")
    assert new_hash != stable_hash
    assert wait_for(
        lambda: get_or_none(apps.read_namespaced_deployment, "qwen-canary", namespace) is None,
        what="the canary Deployment gone",
    )
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["CanaryFailed"]["status"] == "False"
