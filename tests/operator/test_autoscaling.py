"""spec.autoscaling without a cluster: the autoscalers rendered exactly, the no-fight rule
(replicas never rendered, a no-op plan, the handover), and status.autoscaling."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagekeeper_operator.adapters.plan import key_of, plan, stamp
from pagekeeper_operator.api.autoscaling import AutoscalingStatus
from pagekeeper_operator.remediation.actions import server_info
from pagekeeper_operator.render import ClusterFeatures, render_all, unwanted_objects
from pagekeeper_operator.render.autoscaler import SIGNALS, metric_keys, quantity
from pagekeeper_operator.rollout.autoscaling import (
    HANDOVER_MANAGER,
    autoscaling_status,
    handover,
    metric_value,
    owns_replicas,
    scale_reason,
)
from pagekeeper_operator.rollout.canary import CanaryPlan, shape_deployments
from pagekeeper_operator.status.conditions import compute_status
from tests.operator.servers import DEFAULT_IMAGES, make_server

REPO = Path(__file__).resolve().parents[2]
ADAPTER_RULES = REPO / "charts" / "pagekeeper" / "adapter" / "rules.yaml"
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
KEDA = ClusterFeatures(has_scaled_object=True, prometheus_url=PROMETHEUS)
AUTOSCALING = {
    "minReplicas": 2,
    "maxReplicas": 6,
    "targets": {"kvCacheUsage": 0.75, "waitingRequests": 4, "runningRequests": 12},
    "scaleUpStabilizationSeconds": 15,
    "scaleDownStabilizationSeconds": 240,
}
META = {
    "name": "qwen",
    "namespace": "ml",
    "labels": {
        "app.kubernetes.io/name": "pagekeeper-engine",
        "pagekeeper.dev/llmserver": "qwen",
        "app.kubernetes.io/instance": "qwen",
        "app.kubernetes.io/managed-by": "pagekeeper-operator",
        "app.kubernetes.io/part-of": "pagekeeper",
    },
    "ownerReferences": [
        {
            "apiVersion": "pagekeeper.dev/v1alpha1",
            "kind": "LLMServer",
            "name": "qwen",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ],
}
TARGET_REF = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen"}
BEHAVIOR = {
    "scaleUp": {"stabilizationWindowSeconds": 15},
    "scaleDown": {"stabilizationWindowSeconds": 240},
}
NOW = "2025-01-02T03:04:05Z"


def _autoscaled(**spec: Any) -> Any:
    return make_server({"replicas": 3, "autoscaling": AUTOSCALING, **spec})


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["kind"]: obj for obj in objects}


def test_horizontal_pod_autoscaler_on_pods_metrics() -> None:
    objects = render_all(_autoscaled(), DEFAULT_IMAGES, ClusterFeatures())
    assert [o["kind"] for o in objects] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
        "HorizontalPodAutoscaler",
    ]
    assert objects[-1] == {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": META,
        "spec": {
            "scaleTargetRef": TARGET_REF,
            "minReplicas": 2,
            "maxReplicas": 6,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm_kv_cache_usage_perc"},
                        "target": {"type": "AverageValue", "averageValue": "750m"},
                    },
                },
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm_num_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "4"},
                    },
                },
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm_num_requests_running"},
                        "target": {"type": "AverageValue", "averageValue": "12"},
                    },
                },
            ],
            "behavior": BEHAVIOR,
        },
    }


def test_scaled_object_where_keda_is_installed() -> None:
    objects = _by_kind(render_all(_autoscaled(), DEFAULT_IMAGES, KEDA))
    assert "HorizontalPodAutoscaler" not in objects
    selector = 'namespace="ml",llmserver="qwen"'
    assert objects["ScaledObject"] == {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": META,
        "spec": {
            "scaleTargetRef": TARGET_REF,
            "minReplicaCount": 2,
            "maxReplicaCount": 6,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": BEHAVIOR}},
            "triggers": [
                {
                    "type": "prometheus",
                    "name": "kvCacheUsage",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": PROMETHEUS,
                        "query": f"sum(max by (pod) (vllm:kv_cache_usage_perc{{{selector}}}))",
                        "threshold": "0.75",
                    },
                },
                {
                    "type": "prometheus",
                    "name": "waitingRequests",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": PROMETHEUS,
                        "query": f"sum(sum by (pod) (vllm:num_requests_waiting{{{selector}}}))",
                        "threshold": "4",
                    },
                },
                {
                    "type": "prometheus",
                    "name": "runningRequests",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": PROMETHEUS,
                        "query": f"sum(sum by (pod) (vllm:num_requests_running{{{selector}}}))",
                        "threshold": "12",
                    },
                },
            ],
        },
    }


def test_keda_needs_a_prometheus_to_query() -> None:
    no_url = ClusterFeatures(has_scaled_object=True)
    kinds = [o["kind"] for o in render_all(_autoscaled(), DEFAULT_IMAGES, no_url)]
    assert kinds[-1] == "HorizontalPodAutoscaler"


def test_only_targets_above_zero_are_signals() -> None:
    targets = {"kvCacheUsage": 0, "waitingRequests": 2.5, "runningRequests": 0}
    server = make_server({"autoscaling": {"maxReplicas": 2, "targets": targets}})
    hpa = _by_kind(render_all(server, DEFAULT_IMAGES, ClusterFeatures()))
    assert hpa["HorizontalPodAutoscaler"]["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2500m"},
            },
        }
    ]
    scaled = _by_kind(render_all(server, DEFAULT_IMAGES, KEDA))["ScaledObject"]
    assert [(t["name"], t["metadata"]["threshold"]) for t in scaled["spec"]["triggers"]] == [
        ("waitingRequests", "2.5")
    ]


@pytest.mark.parametrize(
    ("value", "text"), [(5.0, "5"), (0.8, "800m"), (0.75, "750m"), (1.5, "1500m"), (100, "100")]
)
def test_quantities_are_written_as_the_api_server_writes_them(value: float, text: str) -> None:
    assert quantity(value) == text


def test_metric_names_are_those_the_adapter_rules_serve() -> None:
    """The chart's prometheus-adapter rules turn each series the HPA reads into its metric."""
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    served = {}
    for rule in rules:
        names = re.search(r'__name__=~?"([^"]+)"', rule["seriesQuery"])
        assert names is not None
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        for signal in SIGNALS:
            if re.fullmatch(names.group(1).strip("^$"), signal.series):
                as_ = rule["name"]["as"].replace("${1}", "$1")
                served[signal.series] = (
                    re.sub(rule["name"]["matches"], as_.replace("$1", r"\1"), signal.series),
                    rule["metricsQuery"].split(" by ")[0],
                )
    assert served == {s.series: (s.metric, s.per_pod) for s in SIGNALS}


def test_the_deployment_never_renders_replicas_under_autoscaling() -> None:
    fixed = _by_kind(render_all(make_server({"replicas": 3}), DEFAULT_IMAGES, ClusterFeatures()))
    assert fixed["Deployment"]["spec"]["replicas"] == 3
    scaled = _by_kind(render_all(_autoscaled(), DEFAULT_IMAGES, ClusterFeatures()))
    assert "replicas" not in scaled["Deployment"]["spec"]
    without = {k: v for k, v in fixed["Deployment"]["spec"].items() if k != "replicas"}
    assert scaled["Deployment"]["spec"] == without
    # The PodDisruptionBudget does not depend on the count: it keeps working as it is.
    assert scaled["PodDisruptionBudget"] == fixed["PodDisruptionBudget"]


def _as_stored(manifest: dict[str, Any], replicas: int) -> dict[str, Any]:
    stored = copy.deepcopy(stamp(manifest))
    if manifest["kind"] == "Deployment":
        stored["spec"]["replicas"] = replicas
    if manifest["kind"] == "HorizontalPodAutoscaler":
        for rule in ("scaleUp", "scaleDown"):
            stored["spec"]["behavior"][rule]["selectPolicy"] = "Max"
            stored["spec"]["behavior"][rule]["policies"] = [
                {"type": "Percent", "value": 100, "periodSeconds": 15}
            ]
        stored["status"] = {"currentReplicas": replicas, "desiredReplicas": replicas}
    return stored


def test_a_count_the_autoscaler_set_is_no_drift() -> None:
    desired = render_all(_autoscaled(), DEFAULT_IMAGES, ClusterFeatures())
    observed = {key_of(m): _as_stored(m, replicas=5) for m in desired}
    assert plan(desired, observed) == []


def test_the_canary_comes_beside_the_autoscaled_pods() -> None:
    desired = render_all(_autoscaled(), DEFAULT_IMAGES, ClusterFeatures())
    analyzing = CanaryPlan(False, 2, 1, None)
    stable = {"metadata": {"labels": {}}, "spec": {"containers": []}}

    def by_name(owns_replicas: bool) -> dict[str, dict[str, Any]]:
        shaped = shape_deployments(desired, analyzing, stable, owns_replicas=owns_replicas)
        return {m["metadata"]["name"]: m for m in shaped if m["kind"] == "Deployment"}

    shaped = by_name(owns_replicas=False)
    assert "replicas" not in shaped["qwen"]["spec"]
    assert shaped["qwen"]["spec"]["template"] == stable
    assert shaped["qwen-canary"]["spec"]["replicas"] == 1
    assert by_name(owns_replicas=True)["qwen"]["spec"]["replicas"] == 2


def test_the_autoscaler_the_server_no_longer_wants_is_pruned() -> None:
    hpa = ("autoscaling/v2", "HorizontalPodAutoscaler", "qwen")
    scaled_object = ("keda.sh/v1alpha1", "ScaledObject", "qwen")
    assert hpa not in unwanted_objects(_autoscaled(), ClusterFeatures())
    assert unwanted_objects(_autoscaled(), KEDA) == [hpa]
    assert unwanted_objects(make_server(), KEDA) == [hpa, scaled_object]
    assert unwanted_objects(_autoscaled(), ClusterFeatures(has_scaled_object=True)) == [
        scaled_object
    ]


def _deployment(replicas: int, managers: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "qwen",
            "managedFields": [
                {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": fields}}
                for m, fields in managers
            ],
        },
        "spec": {"replicas": replicas},
    }


def test_replicas_the_operator_applied_are_handed_over_once() -> None:
    ours = _deployment(2, [("pagekeeper-operator", {"f:replicas": {}, "f:template": {}})])
    assert owns_replicas(ours, "pagekeeper-operator")
    assert handover(_autoscaled(), ours, "pagekeeper-operator") == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "ml"},
        "spec": {"replicas": 2},
    }
    # Handed over (or never ours): nothing to do. Without autoscaling: ours to keep.
    theirs = _deployment(
        2, [("pagekeeper-operator", {"f:template": {}}), (HANDOVER_MANAGER, {"f:replicas": {}})]
    )
    assert handover(_autoscaled(), theirs, "pagekeeper-operator") is None
    assert handover(make_server(), ours, "pagekeeper-operator") is None
    assert handover(_autoscaled(), None, "pagekeeper-operator") is None
    updated = copy.deepcopy(ours)
    updated["metadata"]["managedFields"][0]["operation"] = "Update"
    assert not owns_replicas(updated, "pagekeeper-operator")


def _hpa(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "qwen"}, "status": status}


def _pods_metric(name: str, value: str) -> dict[str, Any]:
    return {"type": "Pods", "pods": {"metric": {"name": name}, "current": {"averageValue": value}}}


SCALED_UP = _hpa(
    currentReplicas=2,
    desiredReplicas=6,
    lastScaleTime="2025-01-02T03:00:00Z",
    currentMetrics=[
        _pods_metric("vllm_kv_cache_usage_perc", "900m"),
        _pods_metric("vllm_num_requests_waiting", "18"),
        _pods_metric("vllm_num_requests_running", "12"),
    ],
    conditions=[
        {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
        {"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas"},
    ],
)


def test_the_reason_names_the_signal_that_asked_for_most() -> None:
    server = _autoscaled()
    assert scale_reason(server, SCALED_UP, False, 2) == (
        "up 2->6: waitingRequests 18/pod, target 4 (held at maxReplicas)"
    )
    down = _hpa(
        desiredReplicas=2,
        currentMetrics=[
            _pods_metric("vllm_kv_cache_usage_perc", "300m"),
            _pods_metric("vllm_num_requests_waiting", "0"),
        ],
    )
    assert scale_reason(server, down, False, 4) == "down 4->2: kvCacheUsage 0.3/pod, target 0.75"
    assert scale_reason(server, _hpa(desiredReplicas=2), False, None) == "to 2"
    # A count set outside the bounds is brought back to them, whatever the metrics say.
    assert scale_reason(server, _hpa(desiredReplicas=6), False, 9) == (
        "down 9->6 (held at maxReplicas)"
    )
    assert scale_reason(server, _hpa(desiredReplicas=2), False, 1) == (
        "up 1->2 (held at minReplicas)"
    )
    # KEDA's HPA names the metric of the n-th trigger s<n>-prometheus.
    keda = _hpa(
        desiredReplicas=3,
        currentMetrics=[
            {
                "type": "External",
                "external": {"metric": {"name": "s1-prometheus"}, "current": {"averageValue": "6"}},
            }
        ],
    )
    assert scale_reason(server, keda, True, 2) == "up 2->3: waitingRequests 6/pod, target 4"
    assert metric_keys(server, True)["s2-prometheus"] == ("runningRequests", 12.0)


def test_status_records_a_scale_once() -> None:
    server = _autoscaled()
    assert autoscaling_status(make_server(), SCALED_UP, False, None, 2) is None
    missing = autoscaling_status(server, None, False, None, 2)
    assert missing == AutoscalingStatus(
        kind="HorizontalPodAutoscaler",
        name="qwen",
        message="HorizontalPodAutoscaler qwen does not exist yet",
    )
    before = AutoscalingStatus(kind="HorizontalPodAutoscaler", name="qwen", desired_replicas=2)
    first = autoscaling_status(server, SCALED_UP, False, before, 2)
    assert first == AutoscalingStatus(
        kind="HorizontalPodAutoscaler",
        name="qwen",
        desired_replicas=6,
        last_scale_time="2025-01-02T03:00:00Z",
        last_scale_reason="up 2->6: waitingRequests 18/pod, target 4 (held at maxReplicas)",
    )
    # Read only after the autoscaler's next sync (its currentReplicas already the new count):
    # the count before is the one status recorded.
    late = copy.deepcopy(SCALED_UP)
    late["status"]["currentReplicas"] = 6
    assert autoscaling_status(server, late, False, before, 6) == first
    assert autoscaling_status(server, late, False, None, 3) == first.model_copy(
        update={"last_scale_reason": first.last_scale_reason.replace("2->6", "3->6")}
    )
    unknown = autoscaling_status(server, late, False, None, 6)
    assert unknown is not None and unknown.last_scale_reason == (
        "to 6: waitingRequests 18/pod, target 4 (held at maxReplicas)"
    )
    # The same scale read again, with other metrics: the reason stays as recorded.
    later = copy.deepcopy(SCALED_UP)
    later["status"]["currentMetrics"] = [_pods_metric("vllm_num_requests_waiting", "1")]
    assert autoscaling_status(server, later, False, first, 6) == first
    broken = _hpa(
        desiredReplicas=6,
        conditions=[
            {
                "type": "ScalingActive",
                "status": "False",
                "reason": "FailedGetPodsMetric",
                "message": "unable to get metric vllm_num_requests_waiting",
            }
        ],
    )
    assert autoscaling_status(server, broken, True, None, 6) == AutoscalingStatus(
        kind="ScaledObject",
        name="keda-hpa-qwen",
        desired_replicas=6,
        message="unable to get metric vllm_num_requests_waiting",
    )


@pytest.mark.parametrize(
    ("text", "value"), [("4", 4.0), ("1500m", 1.5), ("2k", 2000.0), (3, 3.0), ("x", None)]
)
def test_metric_values_are_read_as_quantities(text: str | int, value: float | None) -> None:
    read = metric_value(text)
    assert read == value if value is not None else math.isnan(read)


def test_status_counts_what_the_autoscaler_set() -> None:
    server = _autoscaled()
    deployment = {
        "metadata": {"generation": 2},
        "spec": {"replicas": 5},
        "status": {
            "observedGeneration": 2,
            "replicas": 5,
            "readyReplicas": 4,
            "updatedReplicas": 5,
        },
    }
    scaled = AutoscalingStatus(kind="HorizontalPodAutoscaler", name="qwen", desired_replicas=5)
    status = compute_status(server, deployment, NOW, None, scaled)
    assert (status.replicas, status.desired_replicas, status.ready_replicas) == (5, 5, 4)
    assert status.autoscaling == scaled
    ready = status.condition("Ready")
    assert ready is not None and ready.message == "4/5 replicas ready"
    fixed = compute_status(make_server({"replicas": 3}), deployment, NOW)
    assert (fixed.desired_replicas, fixed.autoscaling) == (3, None)


def test_remediation_counts_the_autoscaled_replicas() -> None:
    body = _autoscaled().model_dump(by_alias=True, exclude_none=True, mode="json")
    assert server_info(body, [], deployment_replicas=5).state.num_desired == 5
    assert server_info(body, []).state.num_desired == 3  # the Deployment unread: spec.replicas
    fixed = make_server({"replicas": 3}).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert server_info(fixed, [], deployment_replicas=5).state.num_desired == 3
