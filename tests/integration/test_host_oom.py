"""An OOMKilled container (host memory, the kubelet's kill) on the real control plane: set on a
pod through the status subresource as the kubelet would, it is classified once as a host OOM,
recorded in status with its kind, and shrinks the host KV tier in the effective policy and the
rendered flag, never a GPU term."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import OperatorProcess
from tests.integration import operator_fixture
from tests.integration.operator_fixture import apply_server, get_server, wait_ready
from tests.integration.test_canary import wait_resyncs

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "replicas": 1,
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    "memoryPolicy": {
        "gpuMemoryUtilization": 0.9,
        "maxModelLen": 4096,
        "kvOffload": {"size": "4Gi"},
    },
}


def engine_args(cluster: Cluster, namespace: str, name: str) -> list[str]:
    deployment = client.AppsV1Api(cluster.api).read_namespaced_deployment(name, namespace)
    [engine] = [c for c in deployment.spec.template.spec.containers if c.name == "engine"]
    return [*(engine.command or []), *(engine.args or [])]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def oom_kill(cluster: Cluster, namespace: str, pod: Any, finished_at: str) -> None:
    """What the kubelet reports after the kernel killed the container at its memory limit."""
    terminated = {
        "reason": "OOMKilled",
        "exitCode": 137,
        "startedAt": "2026-11-23T10:00:00Z",
        "finishedAt": finished_at,
    }
    statuses = [
        {**c.to_dict(), "restartCount": 1, "lastState": {"terminated": terminated}}
        for c in pod.status.container_statuses
    ]
    body = {"status": {"containerStatuses": [client.ApiClient().sanitize_for_serialization(
        {k: v for k, v in s.items() if v is not None}) for s in statuses]}}  # fmt: skip
    client.CoreV1Api(cluster.api).patch_namespaced_pod_status(pod.metadata.name, namespace, body)


def server_pod(cluster: Cluster, namespace: str, name: str) -> Any:
    selector = f"pagekeeper.dev/llmserver={name}"
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector)
    [pod] = [p for p in pods.items if p.metadata.deletion_timestamp is None]
    return pod


def test_an_oom_kill_shrinks_the_host_tier_once_and_no_gpu_term(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver("tiered", SPEC))
    wait_ready(cluster, namespace, "tiered", 1)
    assert flag(engine_args(cluster, namespace, "tiered"), "--kv-offloading-size") == "4"
    pod = server_pod(cluster, namespace, "tiered")
    oom_kill(cluster, namespace, pod, "2026-11-23T10:05:00Z")

    def halved() -> dict[str, Any] | None:
        status: dict[str, Any] = get_server(cluster, namespace, "tiered").get("status", {})
        tier = (status.get("effectiveMemoryPolicy") or {}).get("kvOffload") or {}
        is_rendered = flag(engine_args(cluster, namespace, "tiered"), "--kv-offloading-size")
        return status if tier.get("size") == "2Gi" and is_rendered == "2" else None

    status = wait_for(halved, timeout=120, what="the host tier halved in status and the flag")
    effective = status["effectiveMemoryPolicy"]
    assert (effective["gpuMemoryUtilization"], effective["maxNumBatchedTokens"]) == (0.9, 8192)
    assert status["tuning"]["stepDown"] == {
        "kvOffloadSize": "2Gi",
        "specMemoryPolicyHash": status["specMemoryPolicyHash"],
    }
    [record] = [r for r in status["remediationHistory"] if r["action"] == "step-down"]
    assert (record["pod"], record["alert"], record["outcome"]) == (
        pod.metadata.name,
        "host-unknown",
        "applied",
    )
    assert record["message"] == (
        "HostOutOfMemory: the container exceeded its memory limit; kvOffload.size 4Gi -> 2Gi "
        "after a host out-of-memory kill (floor 1Gi, then off)"
    )
    memory = {c["type"]: c for c in status["conditions"]}["MemoryHealthy"]
    assert (memory["status"], memory["reason"]) == ("False", "HostOutOfMemory")
    # Classified once: later rounds over the same pod statuses step nothing further.
    wait_resyncs(operator, 2)
    server = get_server(cluster, namespace, "tiered")
    steps = [r for r in server["status"]["remediationHistory"] if r["action"] == "step-down"]
    assert len(steps) == 1
    assert server["status"]["effectiveMemoryPolicy"]["kvOffload"]["size"] == "2Gi"
    assert flag(engine_args(cluster, namespace, "tiered"), "--kv-offloading-size") == "2"
    # spec is never written.
    assert server["spec"]["memoryPolicy"]["kvOffload"] == {"size": "4Gi", "backend": "native"}
