"""The InferencePool that puts the server's pods behind a Gateway API Inference Extension
gateway (`inference.networking.k8s.io/v1`)."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.gateway import InferencePoolSpec
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.meta import HTTP_PORT, object_meta, selector_labels

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"


def render_inference_pool(server: LLMServer, pool: InferencePoolSpec) -> dict[str, Any]:
    """The pool of the server's pods on the serving port, and the endpoint picker that
    chooses among them (it reads each pod's queue and KV-cache use from /metrics)."""
    picker = pool.endpoint_picker_ref
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": object_meta(server),
        "spec": {
            "selector": {"matchLabels": selector_labels(server)},
            # The pods' port: the gateway sends requests to pod IPs, not through the Service.
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
