"""Autoscaling with real parts only: kube-controller-manager's HorizontalPodAutoscaler
controller, prometheus-adapter registered through the aggregator, a real Prometheus scraping a
real engine on the CPU as one pod's metrics, and the operator keeping pod-deletion costs.

Load fills the engine's queue and the server scales from 1 to 3 pods. The series are then made
to come from the newest pod, and the load drops to requests that run without waiting: the
server scales back to 1 after the stabilization window, and the pod it keeps is the loaded one,
although the ReplicaSet would otherwise remove the newest pods first. No request fails.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.adapter import custom_metrics_api, pod_metric, start_adapter
from harness.cluster import Cluster, wait_for
from harness.cpu_engine import (
    EngineShape,
    StreamingLoad,
    spawn_engine,
    stop_engine,
    wait_engine_ready,
    write_tiny_checkpoint,
)
from harness.loop import (
    OperatorProcess,
    PodWatch,
    get_server,
    install_crd,
    llmserver,
    restrict_namespace,
    server_pods,
    wait_ready_pods,
)
from harness.processes import exporter
from harness.prometheus import Prometheus, engine_scrape, pod_scrape

SHAPE = EngineShape()
COST = "controller.kubernetes.io/pod-deletion-cost"
# One waiting request per pod is the target: the queue of 8 workers on 4 running sequences
# asks for 4 pods, held at 3.
AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targets": {"kvCacheUsage": 0, "waitingRequests": 1},
    "scaleUpStabilizationSeconds": 0,
    # A scale-down takes the highest recommendation over this window, two or three of the
    # controller's syncs: one sync that finds the busy pod without a series (a scrape of the
    # busy engine past its 1 s timeout) reads only the idle pods' zeros, and alone it must not
    # remove a pod while step 2 checks every pod's cost.
    "scaleDownStabilizationSeconds": 30,
}
# The controller syncs every 15 s; a step takes its window plus up to two syncs.
SCALE_TIMEOUT_S = 120


def server_spec() -> dict[str, Any]:
    return {
        "model": {
            "source": "/models/tiny-llama",
            "servedModelName": SHAPE.model_name,
            "loadFormat": "dummy",
        },
        "resources": {"gpus": 1},
        "autoscaling": AUTOSCALING,
        "shutdownGracePeriodSeconds": 30,
    }


@contextlib.contextmanager
def logs_on_failure(*logs: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for log in logs:
            if log.exists():
                print(f"===== {log.name} =====\n{log.read_text(errors='replace')[-6000:]}")
        raise


def costs(cluster: Cluster, namespace: str) -> dict[str, str | None]:
    return {
        pod.metadata.name: (pod.metadata.annotations or {}).get(COST)
        for pod in server_pods(cluster, namespace, "scaled")
    }


def last_scale(cluster: Cluster, namespace: str) -> str:
    status = get_server(cluster, namespace, "scaled").get("status") or {}
    return str((status.get("autoscaling") or {}).get("lastScaleReason") or "")


def names_a_scale_down_to_one(reason: str) -> bool:
    """`down N->1: waitingRequests V/pod, target 1` with a reading that asks for one pod: the
    HPA wants ceil(N x V / target) pods, so V <= 1/N (the heavy load's last request may still
    be waiting at the sync that decides: one across three pods reads 0.333/pod). A reading of
    0 asks for none, so the reason may end `(held at minReplicas)`."""
    found = re.match(r"down (\d+)->1: waitingRequests ([0-9.e-]+)/pod, target 1\b", reason)
    return found is not None and int(found[1]) * float(found[2]) <= 1.0 + 1e-2


@pytest.mark.e2e
def test_load_scales_out_and_scale_down_removes_the_least_loaded_pod(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    with contextlib.ExitStack() as stack:
        engine = spawn_engine(write_tiny_checkpoint(tmp_path / "model"), tmp_path / "engine", SHAPE)
        stack.callback(stop_engine, engine)
        prometheus = Prometheus(tmp_path / "prometheus", [], None).start([])
        stack.callback(prometheus.stop)
        assert prometheus.service is not None
        adapter = start_adapter(cluster, prometheus.service.url, tmp_path / "adapter")
        stack.callback(adapter.stop)
        operator = OperatorProcess(
            cluster.kubeconfig,
            namespace,
            tmp_path / "operator",
            extra_env={
                "PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url,
                "PAGEKEEPER_DELETION_COST_SECONDS": "2",
            },
        )
        stack.callback(operator.stop)
        stack.enter_context(logs_on_failure(operator.log, adapter.log, engine.log))
        stack.enter_context(custom_metrics_api(cluster, adapter, namespace))
        operator.wait_ready()

        cluster.apply_yaml(llmserver("scaled", server_spec()), "-n", namespace)
        (first,) = wait_ready_pods(cluster, namespace, "scaled", 1)
        wait_engine_ready(engine)
        prometheus.reload([engine_scrape(engine, (namespace, first, "scaled"))])
        wait_for(
            lambda: first in pod_metric(cluster, namespace, "vllm_num_requests_waiting"),
            timeout=60,
            what="the custom metric of the first pod through the aggregator",
        )
        pods = PodWatch(cluster.kubeconfig, namespace).start()
        stack.callback(pods.stop)

        # 1. A full queue: 1 -> 3 pods.
        heavy = StreamingLoad(engine.url, SHAPE.model_name, num_workers=8).start()
        stack.callback(heavy.stop)
        three = wait_ready_pods(cluster, namespace, "scaled", 3, timeout=SCALE_TIMEOUT_S)
        assert first in three
        reason = wait_for(
            lambda: (
                last_scale(cluster, namespace).startswith("up 1->3")
                and last_scale(cluster, namespace)
            ),
            timeout=60,
            what="status.autoscaling naming the scale-up",
        )
        assert "waitingRequests" in reason and reason.endswith("(held at maxReplicas)"), reason

        # 2. The series now come from a pod the scale-up made: it carries the load, the
        # others none, and the costs say so.
        newest = max(
            (p for p in server_pods(cluster, namespace, "scaled") if p.metadata.name != first),
            key=lambda p: (p.metadata.creation_timestamp, p.metadata.name),
        ).metadata.name
        idle = sorted(set(three) - {newest})
        # the others report no requests (a pod with no series at all keeps its last cost)
        zero = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
        idle_port, _ = stack.enter_context(exporter(zero))
        prometheus.reload([
            engine_scrape(engine, (namespace, newest, "scaled")),
            pod_scrape(idle_port, *((namespace, p, "scaled") for p in idle), job="idle"),
        ])  # fmt: skip

        def loaded_newest() -> bool:
            now = costs(cluster, namespace)
            return int(now.get(newest) or 0) > 0 and all(now.get(p) == "0" for p in idle)

        try:
            wait_for(loaded_newest, timeout=60, what=f"deletion costs: {newest} busy, others idle")
        except AssertionError as exc:  # say what the pods carry instead
            held = (costs(cluster, namespace), last_scale(cluster, namespace))
            raise AssertionError(f"{exc}; costs, lastScaleReason: {held!r}") from exc

        # 3. The queue drains while one request at a time keeps running on the newest pod (it
        # fits the KV pool, so it never waits): back to 1 pod, and it is the loaded one.
        light = StreamingLoad(engine.url, SHAPE.model_name, num_workers=1)
        stack.callback(light.stop)
        light.start()
        heavy.stop_new()
        assert heavy.join(), "the heavy load's requests did not finish"
        (kept,) = wait_ready_pods(cluster, namespace, "scaled", 1, timeout=2 * SCALE_TIMEOUT_S)
        assert kept == newest, f"kept {kept}, the loaded pod was {newest}"
        pods.wait_seen(lambda w: all(w.was_deleted(p) for p in idle), f"{idle} deleted")
        assert not pods.was_deleted(newest)
        try:
            wait_for(
                lambda: names_a_scale_down_to_one(last_scale(cluster, namespace)),
                timeout=60,
                what="status.autoscaling naming the scale-down",
            )
        except AssertionError as exc:  # say what status holds instead
            reason = last_scale(cluster, namespace)
            raise AssertionError(f"{exc}; lastScaleReason: {reason!r}") from exc
        light.stop_new()
        assert light.join(), "the light load's requests did not finish"

    assert pods.error is None
    assert heavy.num_completed > 0 and light.num_completed > 0
    assert (heavy.num_failed, light.num_failed) == (0, 0), heavy.last_error or light.last_error
