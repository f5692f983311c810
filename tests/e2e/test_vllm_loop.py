"""The memory loop for a vLLM-runtime LLMServer, with real parts only.

The operator runs as a subprocess on the local control plane; a vLLM server's two pods sit on
KWOK GPU nodes. pagekeeper's launcher runs as the container would run it, with a child in place
of `vllm serve` (vLLM needs a GPU) that writes its GPU process's allocator report through the
plugin's own writer: 8 GiB reserved, 1 GiB of it allocated. A real Prometheus scrapes the
launcher's /metrics as one pod's `pk-metrics` endpoint, with the rules rendered for the server;
a real Alertmanager posts the fragmentation alert to the operator, which evicts exactly that pod.
Then the launcher reports a child that died of a CUDA OOM and exited 0 (what vLLM does): its
termination message, set on a pod as the kubelet would, steps the effective policy down.
"""

from __future__ import annotations

import contextlib
import signal
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
    server_pods,
    wait_history,
    wait_ready_pods,
)
from harness.processes import free_port, start_alertmanager
from harness.prometheus import Prometheus, pod_scrape
from tests.support.vllm_launcher import start_launcher, stop_launcher

ALERT = "PagekeeperFragmentationHigh"
SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"},
    "runtime": "vllm",
    "replicas": 2,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "remediation": {
        "hysteresisSeconds": 2,
        "cooldownSeconds": 600,
        "triggers": {
            "fragmentation": {"threshold": 0.5, "minBytes": "1Gi", "for": "2s"},
            "kvCacheSaturation": {"enabled": False},
            "queueBacklog": {"enabled": False},
            "engineStalled": {"enabled": False},
        },
    },
}


def _set_terminated(cluster: Cluster, namespace: str, pod: client.V1Pod, message: str) -> None:
    """What the kubelet reports once the container restarted after that exit."""
    terminated = {
        "exitCode": 1,
        "reason": "Error",
        "message": message,
        "startedAt": "2026-11-24T10:00:00Z",
        "finishedAt": "2026-11-24T10:05:00Z",
    }
    api = client.ApiClient()
    statuses = [
        {
            **{k: v for k, v in api.sanitize_for_serialization(c).items() if v is not None},
            "restartCount": 1,
            "lastState": {"terminated": terminated},
        }
        for c in pod.status.container_statuses
    ]
    client.CoreV1Api(cluster.api).patch_namespaced_pod_status(
        pod.metadata.name, namespace, {"status": {"containerStatuses": statuses}}
    )


def test_the_plugins_series_evict_that_pod_and_an_oom_exit_steps_the_policy_down(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    with contextlib.ExitStack() as stack:
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver("upstream", SPEC)], "-n", namespace)
        first, second = sorted(wait_ready_pods(cluster, namespace, "upstream", 2))

        port = free_port()
        launcher = start_launcher(tmp_path, "report", metrics_port=port, capture=False)
        stack.callback(stop_launcher, launcher)
        rules = rules_file(cluster, namespace, "upstream", tmp_path / "rules.yml")
        assert ALERT in rules.read_text()
        alertmanager = start_alertmanager(
            tmp_path / "alertmanager", operator.webhook_url, operator.token
        )
        stack.callback(alertmanager.stop)
        prometheus = Prometheus(tmp_path / "prometheus", [rules], alertmanager)
        stack.callback(prometheus.stop)
        prometheus.start([pod_scrape(port, (namespace, first, "upstream"), job="pk-metrics")])
        try:
            evicted = wait_history(
                cluster, namespace, "upstream", 120, pod=first, action="evict", outcome="evicted"
            )
        except AssertionError:
            print(operator.log_tail(8000))
            print(alertmanager.log.read_text(errors="replace")[-3000:])
            raise
        assert evicted["alert"] == ALERT
        assert evicted["message"] == f"{ALERT}: evicted {namespace}/{first}"
        survivors = wait_ready_pods(cluster, namespace, "upstream", 2)
        assert first not in survivors and second in survivors
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0

        # vLLM's engine core dies of a CUDA OOM and vLLM exits 0: the launcher exits 1 and says
        # why; the kubelet puts that on the pod.
        dead = start_launcher(tmp_path, "runtime-oom", capture=False)
        assert dead.wait(timeout=60) == 1
        message = (tmp_path / "runtime-oom.termination-log").read_text()
        assert message.startswith("pagekeeper-oom kind=gpu phase=runtime detail=vLLM: CUDA")
        [pod] = [
            p for p in server_pods(cluster, namespace, "upstream") if p.metadata.name == second
        ]
        _set_terminated(cluster, namespace, pod, message)

        def stepped_down() -> dict[str, Any] | None:
            status = get_server(cluster, namespace, "upstream").get("status", {})
            policy = status.get("effectiveMemoryPolicy") or {}
            return status if policy.get("gpuMemoryUtilization") == 0.85 else None

        status = wait_for(stepped_down, timeout=120, what="the policy stepped down")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["MemoryHealthy"]["status"] == "False"
    assert conditions["MemoryHealthy"]["reason"] == "GPUOutOfMemoryAtRuntime"
    assert (
        "402.27 MiB reserved by PyTorch but unallocated" in conditions["MemoryHealthy"]["message"]
    )
    assert (
        get_server(cluster, namespace, "upstream")["spec"]["memoryPolicy"]["gpuMemoryUtilization"]
        == 0.9
    )  # never written to spec
