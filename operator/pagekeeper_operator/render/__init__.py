"""Pure rendering: an LLMServer in, the Kubernetes objects that serve it out.

Nothing here talks to the API; `kube` applies what these functions return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagekeeper_operator.alerts import render_prometheus_rule
from pagekeeper_operator.api.llmserver import LLMServer
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


def render_all(
    server: LLMServer, default_images: Mapping[str, str], features: ClusterFeatures
) -> list[dict[str, Any]]:
    """Every object the server needs, in apply order (the Deployment's Service first)."""
    objects = [render_service(server)]
    if server.spec.disruption_budget.managed:
        objects.append(render_pod_disruption_budget(server))
    objects.append(render_deployment(server, default_images))
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
            )
        )
    return objects


def unwanted_objects(server: LLMServer) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of objects this server may once have had and must not have now;
    the reconcile deletes those it controls."""
    if server.spec.disruption_budget.managed:
        return []
    return [("policy/v1", "PodDisruptionBudget", server.metadata.name)]


__all__ = [
    "ClusterFeatures",
    "render_all",
    "render_deployment",
    "render_pod_disruption_budget",
    "render_service",
    "render_service_monitor",
    "unwanted_objects",
]
