"""The autoscaling scene of the demo (`make demo-autoscale`, or `hack/demo.py --autoscaling`).

On the local control plane, with kube-controller-manager's own HorizontalPodAutoscaler
controller: an LLMServer like examples/llmserver-small.yaml with spec.autoscaling (1 to 3 pods,
one waiting request per pod), prometheus-adapter registered through the aggregator, a real
Prometheus scraping the engine on the CPU as one pod's metrics, and the operator keeping the
pods' deletion costs. A full queue scales the server out to 3 pods; then the series come from
the newest pod, the queue drains while one request keeps running there, and the server scales
back to 1 pod, keeping the loaded one. `hack/demo.py` provides the cluster, the narration and
the API key's Secret, which the server's spec.apiKey names; the engine wants the key and the load
sends it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

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
from harness.loop import OperatorProcess, PodWatch, server_pods, wait_ready_pods
from harness.processes import exporter
from harness.prometheus import Prometheus, engine_scrape, pod_scrape
from harness.tools import REPO

EXAMPLE = REPO / "examples" / "llmserver-small.yaml"
SHAPE = EngineShape(model_name="qwen3-0.6b")
COST = "controller.kubernetes.io/pod-deletion-cost"
AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targets": {"kvCacheUsage": 0, "waitingRequests": 1},
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 10,
}
STEP_TIMEOUT_S = 240
Say = Callable[[str], None]


def demo_server(api_key_secret: str) -> dict[str, Any]:
    """The small example with autoscaling instead of a fixed count, no model volume, and the
    OpenAI endpoints locked by the key in Secret `api_key_secret`."""
    server: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = server["spec"]
    spec.pop("replicas", None)
    spec.pop("podTemplate", None)
    spec["model"]["loadFormat"] = "dummy"
    spec["autoscaling"] = AUTOSCALING
    spec["apiKey"] = {"secretName": api_key_secret}
    return server


def get_llms(cluster: Cluster, namespace: str) -> str:
    return cluster.kubectl("get", "llms", "-n", namespace).stdout


def costs(cluster: Cluster, namespace: str, name: str) -> str:
    pods = server_pods(cluster, namespace, name)
    return ", ".join(
        f"{p.metadata.name}={(p.metadata.annotations or {}).get(COST, '-')}" for p in pods
    )


def watch_count(cluster: Cluster, namespace: str, name: str, count: int, say: Say) -> list[str]:
    """Report the server's columns every few seconds until `count` pods are ready."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        row = get_llms(cluster, namespace).splitlines()[-1]
        if row != last:
            say(f"kubectl get llms: {' '.join(row.split())}")
            last = row
        with contextlib.suppress(AssertionError):
            return wait_ready_pods(cluster, namespace, name, count, timeout=3)
    raise TimeoutError(f"{name} did not reach {count} ready pods in {STEP_TIMEOUT_S} s")


def scene(
    stack: contextlib.ExitStack,
    workdir: Path,
    cluster: Cluster,
    namespace: str,
    say: Say,
    show: Callable[[str, str], None],
    api_key_secret: str,
    api_key: str,
) -> None:
    say("starting the engine on the CPU (a tiny Llama, dummy weights, a queue behind 4 slots)")
    checkpoint = write_tiny_checkpoint(workdir / "model")
    engine = spawn_engine(checkpoint, workdir / "engine", SHAPE, ["--api-key", api_key])
    stack.callback(stop_engine, engine)
    prometheus = Prometheus(workdir / "prometheus", [], None).start([])
    stack.callback(prometheus.stop)
    assert prometheus.service is not None
    say(f"Prometheus at {prometheus.service.url}")
    adapter = start_adapter(cluster, prometheus.service.url, workdir / "adapter")
    stack.callback(adapter.stop)
    stack.enter_context(custom_metrics_api(cluster, adapter, namespace))
    say(
        "prometheus-adapter registered as custom.metrics.k8s.io/v1beta1 through the aggregator "
        "(charts/pagekeeper/adapter/rules.yaml)"
    )
    operator = OperatorProcess(
        cluster.kubeconfig,
        namespace,
        workdir / "operator",
        extra_env={
            "PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url,
            "PAGEKEEPER_DELETION_COST_SECONDS": "2",
        },
    )
    stack.callback(operator.stop)
    operator.wait_ready()
    say("operator up, reading requests in flight from Prometheus for the pod-deletion costs")

    server = demo_server(api_key_secret)
    name = server["metadata"]["name"]
    show("spec.autoscaling", yaml.safe_dump(server["spec"]["autoscaling"], sort_keys=False))
    cluster.apply_yaml(server, "-n", namespace)
    (first,) = wait_ready_pods(cluster, namespace, name, 1)
    show(
        "the HorizontalPodAutoscaler the operator rendered",
        cluster.kubectl("get", "hpa", name, "-n", namespace, "-o", "yaml").stdout.split("status:")[
            0
        ],
    )
    wait_engine_ready(engine)
    prometheus.reload([engine_scrape(engine, (namespace, first, name))])
    say(f"the engine's series carry pod={first}; waiting for the adapter to serve them")
    wait_for(
        lambda: first in pod_metric(cluster, namespace, "vllm_num_requests_waiting"),
        timeout=60,
        what="the custom metric through the aggregator",
    )
    pods = PodWatch(cluster.kubeconfig, namespace).start()
    stack.callback(pods.stop)

    say("driving load: 8 streaming completions at once, 4 run and 4 wait")
    heavy = StreamingLoad(engine.url, SHAPE.model_name, num_workers=8, api_key=api_key).start()
    stack.callback(heavy.stop)
    started = time.monotonic()
    three = watch_count(cluster, namespace, name, 3, say)
    say(f"scaled out to 3 pods in {time.monotonic() - started:.0f} s")
    show("kubectl get llms", get_llms(cluster, namespace))

    newest = max(
        (p for p in server_pods(cluster, namespace, name) if p.metadata.name != first),
        key=lambda p: (p.metadata.creation_timestamp, p.metadata.name),
    ).metadata.name
    # the other pods report no requests (a pod with no series keeps its last cost)
    zero = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    idle_port, _ = stack.enter_context(exporter(zero))
    idle = [(namespace, p, name) for p in three if p != newest]
    prometheus.reload([
        engine_scrape(engine, (namespace, newest, name)),
        pod_scrape(idle_port, *idle, job="idle"),
    ])  # fmt: skip
    say(f"the engine's series now carry pod={newest}, one of the new pods; the others report 0")

    say(
        f"the operator moves the load to {newest} in the pod-deletion costs (a pod's cost is "
        "the most requests it had in flight over 30 s, so the first pod's ages out)"
    )

    def only_newest_loaded() -> bool:
        now = {
            p.metadata.name: int((p.metadata.annotations or {}).get(COST) or 0)
            for p in server_pods(cluster, namespace, name)
        }
        return now.get(newest, 0) > 0 and all(v == 0 for k, v in now.items() if k != newest)

    wait_for(only_newest_loaded, timeout=90, what=f"deletion costs: only {newest} loaded")
    say(f"pod-deletion costs: {costs(cluster, namespace, name)}")

    say("the queue drains; one request at a time keeps running on the loaded pod")
    light = StreamingLoad(engine.url, SHAPE.model_name, num_workers=1, api_key=api_key)
    stack.callback(light.stop)
    light.start()
    heavy.stop_new()
    heavy.join()
    started = time.monotonic()
    (kept,) = watch_count(cluster, namespace, name, 1, say)
    say(f"scaled back to 1 pod in {time.monotonic() - started:.0f} s; kept {kept}")
    removed = [p for p in three if pods.was_deleted(p)]
    outcome = "the loaded pod stayed" if kept == newest else f"the loaded pod was {newest}"
    say(f"removed: {', '.join(removed)}; {outcome}")
    light.stop_new()
    light.join()
    show("kubectl get llms", get_llms(cluster, namespace))
    status = cluster.kubectl(
        "get", "llms", name, "-n", namespace, "-o", "jsonpath={.status.autoscaling}"
    ).stdout
    show("status.autoscaling", yaml.safe_dump(yaml.safe_load(status), sort_keys=False))
    failed = heavy.num_failed + light.num_failed
    done = heavy.num_completed + light.num_completed
    say(f"load: {done} requests completed, {failed} failed")
