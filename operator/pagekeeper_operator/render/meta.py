"""Names, labels and owner references shared by every object rendered for an LLMServer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagekeeper_operator.api.llmserver import API_VERSION, KIND, LLMServer

APP_NAME = "pagekeeper-engine"
MANAGED_BY = "pagekeeper-operator"
SERVER_LABEL = "pagekeeper.dev/llmserver"
POLICY_HASH_ANNOTATION = "pagekeeper.dev/policy-hash"
CONTAINER_NAME = "engine"
HTTP_PORT_NAME = "http"
HTTP_PORT = 8000


def selector_labels(server: LLMServer) -> dict[str, str]:
    """Labels that select this server's pods; immutable once a Deployment exists."""
    return {"app.kubernetes.io/name": APP_NAME, SERVER_LABEL: server.metadata.name}


def common_labels(server: LLMServer) -> dict[str, str]:
    """Labels on every rendered object."""
    return {
        **selector_labels(server),
        "app.kubernetes.io/instance": server.metadata.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "pagekeeper",
    }


def owner_reference(server: LLMServer) -> dict[str, Any]:
    """Makes the garbage collector delete the object with its LLMServer."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": server.metadata.name,
        "uid": server.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_controlled_by(
    obj: Mapping[str, Any], *, uid: str | None = None, kind: str | None = None
) -> bool:
    """Whether `obj`'s controller (the owner reference marked `controller`) is the object with
    `uid` and/or of `kind`; an empty `uid` matches nothing."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is None or uid == "":
        return False
    return (uid is None or controller.get("uid") == uid) and (
        kind is None or controller.get("kind") == kind
    )


def object_meta(server: LLMServer, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or server.metadata.name,
        "namespace": server.metadata.namespace,
        "labels": common_labels(server),
        "ownerReferences": [owner_reference(server)],
    }


def selector_string(server: LLMServer) -> str:
    """The pod selector as `kubectl get -l` takes it (status.selector, the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(server).items()))


# Under runtime vllm: pagekeeper's launcher serves the allocator series of vLLM's GPU processes.
METRICS_PORT_NAME = "pk-metrics"
METRICS_PORT = 8001
