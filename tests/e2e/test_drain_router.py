"""A pod replaced through the Eviction API while requests stream through its Service loses none
of them, with real parts only.

The operator runs as a subprocess on the local control plane; each pod of a two-replica
LLMServer runs the CPU engine as its stand-in (`pod_fleet`), ended at its deletion as a kubelet
ends it (preStop sleep, SIGTERM, grace period); a client routes requests over the Service's
ready endpoints as kube-proxy would (`router`). One pod is evicted under that load: the
endpoint goes at its deletion, the replacement joins once its engine is ready, and every
request either completes or is answered 503 with Retry-After and completes on another pod.
At its SIGTERM the evicted engine had a stream running: /ready fails at once, a new request is
refused with 503 and Retry-After, and the stream runs to its end before the engine exits 0.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import write_tiny_checkpoint
from harness.loop import (
    OperatorProcess,
    install_crd,
    llmserver,
    restrict_namespace,
    server_pods,
    wait_ready_pods,
)
from pagekeeper_engine.frontend.state import RETRY_AFTER_DRAINING_S
from tests.support.pod_fleet import PodFleet
from tests.support.router import EndpointRouter

NAME = "drains"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny-llama"},
    "replicas": 2,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxModelLen": 512},
}
# Bounds on conditions, not speeds: engine start-up on a busy 2-core machine.
START_TIMEOUT_S = 240
NUM_BEFORE = 20  # requests completed through the Service before the eviction


def test_an_eviction_under_load_loses_no_request(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny-llama")
    core = client.CoreV1Api(cluster.api)
    with contextlib.ExitStack() as stack:
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver(NAME, SPEC)], "-n", namespace)
        first = wait_ready_pods(cluster, namespace, NAME, 2)

        fleet = PodFleet(cluster.kubeconfig, namespace, NAME, checkpoint, tmp_path / "pods")
        stack.callback(fleet.stop)
        fleet.start()
        wait_for(
            lambda: fleet.error is not None or fleet.ready >= set(first),
            timeout=START_TIMEOUT_S,
            what="both pods' engines ready",
        )
        assert fleet.error is None, fleet.error
        router = EndpointRouter(cluster.kubeconfig, namespace, NAME, fleet, num_workers=3)
        stack.callback(router.stop)
        router.start()
        wait_for(
            lambda: all(router.log.served_by[pod] >= NUM_BEFORE // 2 for pod in first),
            timeout=120,
            what="requests served by both pods",
        )

        evicted, kept = first
        eviction = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=evicted, namespace=namespace)
        )
        core.create_namespaced_pod_eviction(evicted, namespace, eviction)
        served_before = router.log.served_by[evicted]

        def replaced() -> str | None:
            pods = {p.metadata.name for p in server_pods(cluster, namespace, NAME)}
            [new] = list(pods - set(first)) or [None]
            return new if new is not None and new in fleet.ready else None

        new = wait_for(replaced, timeout=START_TIMEOUT_S, what="the replacement's engine ready")
        probe = fleet.drains[evicted]
        wait_for(
            lambda: probe.exit_code is not None and router.log.served_by[new] >= 5,
            timeout=120,
            what="the evicted engine's exit and requests served by the replacement",
        )
        router.stop()
        assert fleet.error is None, fleet.error
        assert router.error is None, router.error

    log = router.log
    # Nothing lost: every request completed, some after a retryable answer.
    assert log.lost == []
    assert all(status == 503 and retry_after for _, status, retry_after in log.retried), log.retried
    assert log.served_by[kept] > 0 and log.served_by[new] >= 5
    # The evicted pod served nothing after its endpoint went: requests in flight at the
    # eviction were the last.
    assert log.served_by[evicted] - served_before <= 3, (log.served_by, served_before)
    # The engine's side of the drain, at its SIGTERM with a stream running.
    assert probe.errors == []
    assert probe.ready_status == 503
    retry_after = str(int(RETRY_AFTER_DRAINING_S))
    assert (probe.refused_status, probe.refused_retry_after) == (503, retry_after)
    assert probe.stream_finish_reason == "length"
    assert probe.stream_text != ""
    assert probe.exit_code == 0
