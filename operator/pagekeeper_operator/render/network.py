"""The objects around the pods: Service, PodDisruptionBudget and ServiceMonitor."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.meta import HTTP_PORT_NAME, object_meta, selector_labels

METRICS_INTERVAL = "15s"


def render_service(server: LLMServer) -> dict[str, Any]:
    """OpenAI-compatible HTTP and /metrics, on the pods' port named `http`."""
    service = server.spec.service
    meta = object_meta(server)
    if service.annotations:
        meta["annotations"] = dict(service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": service.type,
            "selector": selector_labels(server),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": service.port,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def render_pod_disruption_budget(server: LLMServer) -> dict[str, Any]:
    """Bounds voluntary disruptions, remediation evictions included.

    Unhealthy pods may always be evicted: a pod that is not ready serves nothing, and
    replacing it is exactly what remediation is for.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(server),
        "spec": {
            "maxUnavailable": server.spec.remediation.max_unavailable,
            "selector": {"matchLabels": selector_labels(server)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_service_monitor(server: LLMServer) -> dict[str, Any]:
    """Tells a Prometheus Operator to scrape the engine's /metrics through the Service."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": object_meta(server),
        "spec": {
            "selector": {"matchLabels": selector_labels(server)},
            "endpoints": [
                {"port": HTTP_PORT_NAME, "path": "/metrics", "interval": METRICS_INTERVAL}
            ],
        },
    }
