"""The reconcile's wiring of the fit gate, over an in-memory Kubernetes: a spec that does not
fit gets no Deployment (or keeps the running template), a status and one Event."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from pagekeeper_operator.adapters.plan import ObjectKey, key_of
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
from pagekeeper_operator.render import ClusterFeatures
from tests.operator.servers import DEFAULT_IMAGES, server_body

H100 = {
    "metadata": {
        "name": "gpu-a",
        "labels": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.memory": "81559",
        },
    }
}
SPEC = {
    "model": {"source": "/models/Llama-3.1-70B-Instruct"},
    "memoryPolicy": {"maxModelLen": 32768},
}


class MemoryKube:
    """What `reconcile` calls of `Kube`, over a dict of objects."""

    field_manager = "pagekeeper"

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.node_selectors: list[str] = []

    def features(self) -> ClusterFeatures:
        return ClusterFeatures()

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        self.node_selectors.append(label_selector)
        return self.nodes

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        return copy.deepcopy(self.objects.get((api_version, kind, name)))

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        return []

    def observe(self, namespace: str, keys: Iterable[ObjectKey]) -> dict[ObjectKey, Any]:
        return {key: self.get(key[0], key[1], namespace, key[2]) for key in keys}

    def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.objects[key_of(manifest)] = copy.deepcopy(manifest)
        return copy.deepcopy(manifest)

    def delete(self, key: ObjectKey, namespace: str, uid: str) -> None:
        self.objects.pop(key, None)

    def create_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)


def _server(spec: dict[str, Any], status: dict[str, Any] | None = None) -> LLMServer:
    return LLMServer.from_body(server_body(spec, status=status or {}))


def _deployment_key() -> ObjectKey:
    return ("apps/v1", "Deployment", "qwen")


def test_a_new_server_that_does_not_fit_gets_no_deployment() -> None:
    kube = MemoryKube([H100])
    result = reconcile(kube, _server(SPEC), DEFAULT_IMAGES, now="2026-11-29T01:00:00Z")  # type: ignore[arg-type]
    assert _deployment_key() not in kube.objects
    assert ("v1", "Service", "qwen") in kube.objects  # the rest is applied
    patch = result.status_patch
    assert patch["memoryPlan"]["state"] == "DoesNotFit"
    fits = next(c for c in patch["conditions"] if c["type"] == "PolicyFits")
    assert (fits["status"], fits["reason"]) == ("False", "WeightsExceedGPU")
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Warning", "PolicyDoesNotFit")]
    # The same verdict again: no second Event.
    again = _server(SPEC, status=patch)
    reconcile(kube, again, DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    assert len(kube.events) == 1


def test_a_change_that_does_not_fit_keeps_the_running_template() -> None:
    kube = MemoryKube([H100])
    fitting = {**SPEC, "parallelism": {"tensor": 4}}
    result = reconcile(kube, _server(fitting), DEFAULT_IMAGES, now="2026-11-29T01:00:00Z")  # type: ignore[arg-type]
    assert result.status_patch["memoryPlan"]["state"] == "Fits"
    running = kube.objects[_deployment_key()]["spec"]["template"]
    assert "--tensor-parallel-size" in running["spec"]["containers"][0]["command"]
    reconcile(kube, _server(SPEC), DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    assert kube.objects[_deployment_key()]["spec"]["template"] == running
    assert kube.node_selectors == ["", ""]


def test_a_tier_no_node_can_hold_gets_no_deployment() -> None:
    """The host side of the gate: the candidate's allocatable memory is below the pod's."""
    small = {**H100, "status": {"allocatable": {"memory": "64Gi"}}}
    kube = MemoryKube([small])
    tier = {
        "model": {"source": "Qwen/Qwen3-8B"},
        "memoryPolicy": {"kvOffload": {"size": "96Gi"}},
    }
    result = reconcile(kube, _server(tier), DEFAULT_IMAGES, now="2026-11-29T01:00:00Z")  # type: ignore[arg-type]
    assert _deployment_key() not in kube.objects
    fits = next(c for c in result.status_patch["conditions"] if c["type"] == "PolicyFits")
    assert (fits["status"], fits["reason"]) == ("False", "HostMemoryExceedsNodes")
    assert result.status_patch["memoryPlan"]["host"]["nodeAllocatable"] == 64 * 2**30
    # A tier the node holds rolls out, with the pod's memory from the plan.
    fitting = {**tier, "memoryPolicy": {"kvOffload": {"size": "32Gi"}}}
    reconcile(kube, _server(fitting), DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    container = kube.objects[_deployment_key()]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["memory"] == "37Gi"  # 32 + 3 + 1 + 1 GiB
