"""Pure rendering: an LLMServer in, the Kubernetes objects that serve it out (Service,
PodDisruptionBudget, Deployment, its autoscaler under spec.autoscaling, and where the cluster
has their CRDs: ServiceMonitor, PrometheusRule, InferencePool).

Nothing here talks to the API; `kube` applies what these functions return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagekeeper_operator.alerts.render import render_prometheus_rule
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.render.autoscaler import (
    HPA_API_VERSION,
    HPA_KIND,
    SCALED_OBJECT_API_VERSION,
    SCALED_OBJECT_KIND,
    render_hpa,
    render_scaled_object,
)
from pagekeeper_operator.render.gateway import (
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    render_inference_pool,
)
from pagekeeper_operator.render.meta import owner_reference
from pagekeeper_operator.render.network import (
    render_pod_disruption_budget,
    render_service,
    render_service_monitor,
)
from pagekeeper_operator.render.workload import render_deployment


@dataclass(frozen=True)
class ClusterFeatures:
    """Optional APIs found in the cluster; objects of absent kinds are not rendered."""

    has_service_monitor: bool = False
    has_prometheus_rule: bool = False
    has_inference_pool: bool = False
    has_scaled_object: bool = False
    # Where KEDA's triggers query the pods' series (the operator's PAGEKEEPER_PROMETHEUS_URL).
    prometheus_url: str | None = None

    @property
    def uses_keda(self) -> bool:
        """A ScaledObject instead of a HorizontalPodAutoscaler: KEDA is installed and its
        triggers have a Prometheus to query."""
        return self.has_scaled_object and bool(self.prometheus_url)


def render_autoscaler(server: LLMServer, features: ClusterFeatures) -> dict[str, Any] | None:
    """The server's autoscaler under spec.autoscaling, None without it."""
    spec = server.spec.autoscaling
    if spec is None:
        return None
    if features.uses_keda:
        assert features.prometheus_url is not None, "uses_keda implies a Prometheus URL"
        return render_scaled_object(server, spec, features.prometheus_url)
    return render_hpa(server, spec)


def render_all(
    server: LLMServer,
    default_images: Mapping[str, str],
    features: ClusterFeatures,
    policy: MemoryPolicy | None = None,
) -> list[dict[str, Any]]:
    """Every object the server needs, in apply order (the Deployment's Service first, its
    autoscaler after it); the pods run `policy` (`render_deployment`)."""
    objects = [render_service(server)]
    if server.spec.disruption_budget.managed:
        objects.append(render_pod_disruption_budget(server))
    objects.append(render_deployment(server, default_images, policy))
    autoscaler = render_autoscaler(server, features)
    if autoscaler is not None:
        objects.append(autoscaler)
    if features.has_service_monitor:
        objects.append(render_service_monitor(server))
    if features.has_prometheus_rule:
        objects.append(
            render_prometheus_rule(
                server.metadata.name,
                server.metadata.namespace,
                server.spec.remediation,
                server.spec.runtime,
                owner_reference(server),
                has_plugin=server.spec.has_vllm_plugin,
            )
        )
    pool = server.spec.gateway.inference_pool
    if features.has_inference_pool and pool is not None:
        objects.append(render_inference_pool(server, pool))
    return objects


def unwanted_objects(server: LLMServer, features: ClusterFeatures) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of objects this server may once have had and must not have now;
    the reconcile deletes those it controls."""
    name = server.metadata.name
    unwanted = []
    if not server.spec.disruption_budget.managed:
        unwanted.append(("policy/v1", "PodDisruptionBudget", name))
    if features.has_inference_pool and server.spec.gateway.inference_pool is None:
        unwanted.append((INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, name))
    is_autoscaled = server.spec.is_autoscaled
    if not is_autoscaled or features.uses_keda:
        unwanted.append((HPA_API_VERSION, HPA_KIND, name))
    if features.has_scaled_object and not (is_autoscaled and features.uses_keda):
        unwanted.append((SCALED_OBJECT_API_VERSION, SCALED_OBJECT_KIND, name))
    return unwanted


__all__ = [
    "ClusterFeatures",
    "render_all",
    "render_autoscaler",
    "render_deployment",
    "render_inference_pool",
    "render_pod_disruption_budget",
    "render_service",
    "render_service_monitor",
    "unwanted_objects",
]
