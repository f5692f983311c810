"""Prometheus goes away under the operator, with real parts only: the local control plane
(KWOK GPU nodes), the operator as a subprocess with PAGEKEEPER_PROMETHEUS_URL, and a real
Prometheus scraping plain HTTP exporters as the pods (static labels make their series, and
their `up`, the pods' own, as the ServiceMonitor's relabelings do in a cluster).

- During a canary's analysis: once Prometheus has data for the canary pod it is stopped. The
  canary holds past its analysisSeconds (never promoted without data), says why in status and
  an Event, and after PAGEKEEPER_CANARY_NO_DATA_SECONDS is taken back on `noData`: its
  Deployment deleted, the stable replicas never replaced.
- During autoscaling: kube-controller-manager's HorizontalPodAutoscaler on prometheus-adapter's
  custom metrics scales a server to 2 pods and the operator writes the pods' deletion costs from
  Prometheus. Prometheus is stopped, and then the pods' load drops: what they export now asks
  for 1 pod and for other costs. Once the autoscaler finds no metric (ScalingActive False, also
  in status.autoscaling) and the operator has tried three cost rounds, the count is still 2 (no
  scale-down stabilization would have delayed one) and the costs keep their last values. With
  Prometheus back the count goes to the 1 the load asks for, the less loaded pod going (by its
  kept cost or its new one alike), and the remaining pod's cost to its new load.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.adapter import custom_metrics_api, pod_metric, start_adapter
from harness.cluster import Cluster, wait_for
from harness.loop import (
    OperatorProcess,
    get_server,
    install_crd,
    llmserver,
    restrict_namespace,
    server_events,
    server_pods,
    wait_beside_canary,
    wait_ready_pods,
)
from harness.processes import exporter
from harness.prometheus import Prometheus, pod_scrape

NO_DATA_SECONDS = 30
ANALYSIS_SECONDS = 20
CANARY_SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 2,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": ANALYSIS_SECONDS}},
}
COST = "controller.kubernetes.io/pod-deletion-cost"


def canary_record(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    record: dict[str, Any] = (get_server(cluster, namespace, name).get("status") or {}).get(
        "canary"
    ) or {}
    return record


def test_a_canary_without_prometheus_holds_and_is_taken_back_never_promoted(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    with contextlib.ExitStack() as stack:
        port, _ = stack.enter_context(exporter({"vllm:num_requests_running": 0}))
        prometheus = Prometheus(tmp_path / "prometheus", [], None).start([])
        stack.callback(prometheus.stop)
        assert prometheus.service is not None
        operator = OperatorProcess(
            cluster.kubeconfig,
            namespace,
            tmp_path / "operator",
            extra_env={
                "PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url,
                "PAGEKEEPER_CANARY_NO_DATA_SECONDS": str(NO_DATA_SECONDS),
            },
        )
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver("c", CANARY_SPEC)], "-n", namespace)
        stable = set(wait_ready_pods(cluster, namespace, "c", 2))
        old_template = apps.read_namespaced_deployment("c", namespace).spec.template
        changed = copy.deepcopy(CANARY_SPEC)
        changed["memoryPolicy"]["gpuMemoryUtilization"] = 0.85
        cluster.apply_yaml([llmserver("c", changed)], "-n", namespace)

        def ready_canary() -> str | None:
            for pod in server_pods(cluster, namespace, "c"):
                labels = pod.metadata.labels or {}
                conditions = pod.status.conditions or []
                if labels.get("pagekeeper.dev/canary") == "true" and any(
                    c.type == "Ready" and c.status == "True" for c in conditions
                ):
                    return str(pod.metadata.name)
            return None

        def canary_failed() -> bool:
            status = get_server(cluster, namespace, "c")["status"]
            conditions = {c["type"]: c for c in status["conditions"]}
            return conditions.get("CanaryFailed", {}).get("status") == "True"

        try:
            canary = wait_for(ready_canary, timeout=120, what="a ready canary pod")
            # with maxSurge 0 the canary took one stable pod's place; the other stays
            survivors = wait_beside_canary(cluster, namespace, "c", canary, 1)
            targets = [(namespace, pod, "c") for pod in (*stable, canary)]
            prometheus.reload([pod_scrape(port, *targets, job="pods")])
            watched = wait_for(
                lambda: canary_record(cluster, namespace, "c").get("dataSince"),
                timeout=120,
                what="the canary watched (status.canary.dataSince)",
            )
            prometheus.stop()

            held = wait_for(
                lambda: (r := canary_record(cluster, namespace, "c")).get("dataMissingSince") and r,
                timeout=120,
                what="the canary holding without data",
            )
            assert held["phase"] == "Analyzing" and held["message"].startswith("holding: ")
            failed = wait_for(
                lambda: (
                    (r := canary_record(cluster, namespace, "c")).get("phase") != "Analyzing" and r
                ),
                timeout=NO_DATA_SECONDS + 120,
                what="the canary's outcome",
            )
            # the outcome is written before the Deployments move, the Event and the conditions
            # after them: the operator must still run while they are written
            wait_for(canary_failed, timeout=60, what="the CanaryFailed condition")
        except AssertionError:
            print(operator.log_tail(8000))
            raise

    # Held past its analysisSeconds (counted from the data) without being promoted.
    assert failed["phase"] == "Failed" and failed["failedSignal"] == "noData", failed
    assert failed["finishedAt"] > watched
    assert failed["message"].startswith(
        f"noData: no data for the canary pods since {held['dataMissingSince']} "
        "(Prometheus did not answer: "
    )
    assert failed["message"].endswith(
        f"taken back after {NO_DATA_SECONDS}s rather than promoted unwatched"
    )

    events = server_events(cluster, namespace, "c")
    reasons = [e.reason for e in events]
    # Each gap is said once, when it begins. The gap Prometheus's stop opened is one; before
    # the scrape above reached the canary the operator may have seen it ready and unscraped,
    # an earlier gap with its own Event.
    gaps = [e.message for e in events if e.reason == "CanaryNoData"]
    stopped = [m for m in gaps if m.startswith("holding: Prometheus did not answer: ")]
    earlier = [m for m in gaps if m not in stopped]
    unscraped = f"holding: Prometheus has no successful scrape of canary pod(s) {canary}; "
    assert len(stopped) == 1 and len(earlier) <= 1, gaps
    assert all(m.startswith(unscraped) for m in earlier), gaps
    assert reasons.count("CanaryFailed") == 1
    assert "CanaryPromoted" not in reasons

    def deployments() -> set[str]:
        return {d.metadata.name for d in apps.list_namespaced_deployment(namespace).items}

    wait_for(lambda: "c-canary" not in deployments(), what="the canary Deployment deleted")
    main = apps.read_namespaced_deployment("c", namespace)
    assert main.spec.template.metadata.annotations == old_template.metadata.annotations
    assert main.spec.replicas == 2
    remaining = {p.metadata.name for p in server_pods(cluster, namespace, "c")}
    assert survivors <= remaining and survivors <= stable  # never replaced


AUTOSCALED_SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "resources": {"gpus": 1},
    "autoscaling": {
        "minReplicas": 1,
        "maxReplicas": 2,
        "targets": {"kvCacheUsage": 0, "waitingRequests": 1},
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 0,
    },
}
COSTS_NOT_UPDATED = "pod-deletion costs not updated"


def costs(cluster: Cluster, namespace: str, name: str) -> dict[str, str | None]:
    return {
        pod.metadata.name: (pod.metadata.annotations or {}).get(COST)
        for pod in server_pods(cluster, namespace, name)
    }


def test_autoscaling_without_prometheus_holds_the_count_and_the_deletion_costs(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    hpas = client.AutoscalingV2Api(cluster.api)
    with contextlib.ExitStack() as stack:
        busy, busy_series = stack.enter_context(
            exporter({"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 2})
        )
        light, light_series = stack.enter_context(
            exporter({"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 2})
        )
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
        stack.enter_context(custom_metrics_api(cluster, adapter, namespace))
        operator.wait_ready()
        try:
            cluster.apply_yaml(llmserver("a", AUTOSCALED_SPEC), "-n", namespace)
            (first,) = wait_ready_pods(cluster, namespace, "a", 1)
            prometheus.reload([pod_scrape(busy, (namespace, first, "a"), job="busy")])
            # Two waiting requests on one pod, target one: the autoscaler asks for 2.
            pair = wait_ready_pods(cluster, namespace, "a", 2, timeout=180)
            (second,) = set(pair) - {first}
            scrapes = [
                pod_scrape(busy, (namespace, first, "a"), job="busy"),
                pod_scrape(light, (namespace, second, "a"), job="light"),
            ]
            prometheus.reload(scrapes)
            wait_for(
                lambda: costs(cluster, namespace, "a") == {first: "5", second: "3"},
                timeout=120,
                what="the deletion costs of both pods",
            )
            wait_for(
                lambda: (
                    set(pod_metric(cluster, namespace, "vllm_num_requests_waiting")) == set(pair)
                ),
                timeout=120,
                what="both pods' custom metric through the aggregator",
            )

            prometheus.stop()
            # Unseen while Prometheus is away, the queues empty: the autoscaler would ask for
            # 1 pod (no waiting request), and the costs would be 4 and 0 (running + waiting).
            busy_series.update({"vllm:num_requests_running": 4, "vllm:num_requests_waiting": 0})
            light_series.update({"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0})

            def autoscaler_blind() -> bool:
                hpa = hpas.read_namespaced_horizontal_pod_autoscaler("a", namespace)
                conditions = (hpa.status.conditions if hpa.status else None) or []
                return any(c.type == "ScalingActive" and c.status == "False" for c in conditions)

            wait_for(
                autoscaler_blind, timeout=180, interval=2, what="the autoscaler without metrics"
            )
            rounds = operator.log_tail(10**7).count(COSTS_NOT_UPDATED)
            wait_for(
                lambda: operator.log_tail(10**7).count(COSTS_NOT_UPDATED) >= rounds + 3,
                timeout=120,
                interval=1,
                what="three cost rounds without Prometheus",
            )
            wait_for(
                lambda: (
                    (get_server(cluster, namespace, "a").get("status") or {}).get("autoscaling")
                    or {}
                ).get("message"),
                timeout=120,
                what="status.autoscaling saying the autoscaler has no metric",
            )
            # Held while blind: not the 1 pod and the costs the load now asks for.
            assert apps.read_namespaced_deployment("a", namespace).spec.replicas == 2
            assert wait_ready_pods(cluster, namespace, "a", 2) == sorted(pair)
            assert costs(cluster, namespace, "a") == {first: "5", second: "3"}

            prometheus.restart(scrapes)
            wait_for(
                lambda: apps.read_namespaced_deployment("a", namespace).spec.replicas == 1,
                timeout=180,
                interval=2,
                what="the autoscaler scaling in on the metrics once Prometheus is back",
            )
            # The second pod is the less loaded by its kept cost (3 against 5) and by its new
            # one (0 against 4, or 6 while the window still holds the old samples) alike.
            assert wait_ready_pods(cluster, namespace, "a", 1) == [first]
            wait_for(
                lambda: costs(cluster, namespace, "a") == {first: "4"},
                timeout=120,
                what="the remaining pod's cost from its new load",
            )
        except AssertionError:
            print(operator.log_tail(8000))
            raise
