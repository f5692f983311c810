"""The autoscaler of a server under spec.autoscaling: a HorizontalPodAutoscaler (autoscaling/v2)
on the pods' custom metrics, or a KEDA ScaledObject with Prometheus triggers.

Both scale the Deployment on the same per-pod averages. The HorizontalPodAutoscaler reads Pods
metrics that prometheus-adapter serves with the rules in `charts/pagekeeper/adapter/rules.yaml`
(a vLLM series `vllm:X` becomes the metric `vllm_X`); the ScaledObject's triggers query
Prometheus for the server's total and KEDA divides by the target (AverageValue), which is the
same arithmetic. The series carry `namespace`, `pod` and `llmserver` labels from the
ServiceMonitor's relabelings.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pagekeeper_operator.api.autoscaling import AutoscalingSpec
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.meta import object_meta

HPA_API_VERSION = "autoscaling/v2"
HPA_KIND = "HorizontalPodAutoscaler"
SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"
SCALED_OBJECT_KIND = "ScaledObject"
# KEDA names the HorizontalPodAutoscaler it makes for a ScaledObject `keda-hpa-<name>`.
KEDA_HPA_PREFIX = "keda-hpa-"


@dataclass(frozen=True)
class Signal:
    """One load signal an autoscaler can target: its spec key, series, metric and query."""

    key: str  # the field of spec.autoscaling.targets
    series: str  # the engine's Prometheus series
    per_pod: str  # how one pod's series combine (see the adapter rules)

    @property
    def metric(self) -> str:
        """The custom metric prometheus-adapter serves it as."""
        return self.series.replace(":", "_")


SIGNALS = (
    Signal("kvCacheUsage", "vllm:kv_cache_usage_perc", "max"),
    Signal("waitingRequests", "vllm:num_requests_waiting", "sum"),
    Signal("runningRequests", "vllm:num_requests_running", "sum"),
)


def active_signals(spec: AutoscalingSpec) -> list[tuple[Signal, float]]:
    """The signals with a target above 0, with their targets, in SIGNALS order."""
    targets = spec.targets
    values = {
        "kvCacheUsage": targets.kv_cache_usage,
        "waitingRequests": targets.waiting_requests,
        "runningRequests": targets.running_requests,
    }
    return [(signal, values[signal.key]) for signal in SIGNALS if values[signal.key] > 0]


def quantity(value: float) -> str:
    """A number as the API server writes a quantity back: `5`, `800m`, `1500m`."""
    exact = Decimal(str(value))
    if exact == exact.to_integral_value():
        return str(int(exact))
    return f"{int((exact * 1000).to_integral_value())}m"


def _behavior(spec: AutoscalingSpec) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": spec.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": spec.scale_down_stabilization_seconds},
    }


def _target_ref(server: LLMServer) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": server.metadata.name}


def render_hpa(server: LLMServer, spec: AutoscalingSpec) -> dict[str, Any]:
    """A HorizontalPodAutoscaler of the server's Deployment on Pods metrics (AverageValue)."""
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": signal.metric},
                "target": {"type": "AverageValue", "averageValue": quantity(target)},
            },
        }
        for signal, target in active_signals(spec)
    ]
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": HPA_KIND,
        "metadata": object_meta(server),
        "spec": {
            "scaleTargetRef": _target_ref(server),
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(spec),
        },
    }


def server_query(server: LLMServer, signal: Signal) -> str:
    """PromQL for the server's total of a signal: per pod as the adapter combines it, summed."""
    selector = f'namespace="{server.metadata.namespace}",llmserver="{server.metadata.name}"'
    return f"sum({signal.per_pod} by (pod) ({signal.series}{{{selector}}}))"


def render_scaled_object(
    server: LLMServer, spec: AutoscalingSpec, prometheus_url: str
) -> dict[str, Any]:
    """A KEDA ScaledObject of the server's Deployment with one Prometheus trigger per signal."""
    triggers = [
        {
            "type": "prometheus",
            "name": signal.key,
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus_url,
                "query": server_query(server, signal),
                "threshold": f"{target:g}",
            },
        }
        for signal, target in active_signals(spec)
    ]
    return {
        "apiVersion": SCALED_OBJECT_API_VERSION,
        "kind": SCALED_OBJECT_KIND,
        "metadata": object_meta(server),
        "spec": {
            "scaleTargetRef": _target_ref(server),
            "minReplicaCount": spec.min_replicas,
            "maxReplicaCount": spec.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": triggers,
        },
    }


def autoscaler_hpa_name(server: LLMServer, uses_keda: bool) -> str:
    """The HorizontalPodAutoscaler that scales the Deployment: ours, or the one KEDA makes."""
    name = server.metadata.name
    return f"{KEDA_HPA_PREFIX}{name}" if uses_keda else name


def metric_keys(server: LLMServer, uses_keda: bool) -> dict[str, tuple[str, float]]:
    """HorizontalPodAutoscaler metric name -> (target key, per-pod target), to read its status.

    KEDA names the metric of its n-th trigger `s<n>-prometheus`.
    """
    spec = server.spec.autoscaling
    if spec is None:
        return {}
    active = active_signals(spec)
    if uses_keda:
        return {f"s{i}-prometheus": (s.key, target) for i, (s, target) in enumerate(active)}
    return {signal.metric: (signal.key, target) for signal, target in active}
