"""The objects around the pods: Service, PodDisruptionBudget and ServiceMonitor."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.meta import (
    HTTP_PORT_NAME,
    METRICS_PORT,
    METRICS_PORT_NAME,
    SERVER_LABEL,
    object_meta,
    selector_labels,
)

METRICS_INTERVAL = "15s"
# Prometheus's name for a pod label: every character outside [a-zA-Z0-9_] becomes `_`.
SERVER_LABEL_META = "__meta_kubernetes_pod_label_" + "".join(
    ch if ch.isalnum() else "_" for ch in SERVER_LABEL
)


def render_service(server: LLMServer) -> dict[str, Any]:
    """OpenAI-compatible HTTP and /metrics, on the pods' port named `http`."""
    service = server.spec.service
    meta = object_meta(server)
    if service.annotations:
        meta["annotations"] = dict(service.annotations)
    ports = [
        {
            "name": HTTP_PORT_NAME,
            "port": service.port,
            "targetPort": HTTP_PORT_NAME,
            "protocol": "TCP",
        }
    ]
    if server.spec.runtime == "vllm":
        # The launcher's allocator series, for the ServiceMonitor's second endpoint.
        ports.append(
            {
                "name": METRICS_PORT_NAME,
                "port": METRICS_PORT,
                "targetPort": METRICS_PORT_NAME,
                "protocol": "TCP",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": service.type,
            "selector": selector_labels(server),
            "ports": ports,
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


def _copy_label(source: str, target: str) -> dict[str, Any]:
    return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}


def render_service_monitor(server: LLMServer) -> dict[str, Any]:
    """Tells a Prometheus Operator to scrape the engine's /metrics through the Service (under
    runtime vllm also the launcher's, on `pk-metrics`).

    The alerts select and group by `namespace`, `pod` and `llmserver` (see `alerts`): the
    relabelings set all three from the target's metadata, so every series names its pod and
    its LLMServer whatever the Prometheus Operator's defaults.
    """
    ports = [HTTP_PORT_NAME]
    if server.spec.runtime == "vllm":
        ports.append(METRICS_PORT_NAME)  # the allocator series of vLLM's GPU processes
    endpoints = [
        {
            "port": port,
            "path": "/metrics",
            "interval": METRICS_INTERVAL,
            "relabelings": [
                _copy_label("__meta_kubernetes_namespace", "namespace"),
                _copy_label("__meta_kubernetes_pod_name", "pod"),
                _copy_label(SERVER_LABEL_META, "llmserver"),
            ],
        }
        for port in ports
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": object_meta(server),
        "spec": {"selector": {"matchLabels": selector_labels(server)}, "endpoints": endpoints},
    }
