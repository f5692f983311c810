"""Remediation's Kubernetes edge without a cluster: object mapping and API error handling."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.actions import (
    KubeClusterPort,
    bounded_history,
    event,
    pod_state,
    server_info,
)
from pagekeeper_operator.remediation.decide import PodState
from pagekeeper_operator.remediation.port import EvictionOutcome


def pod_body(
    name: str,
    *,
    owner_kind: str | None = "ReplicaSet",
    ready: str = "True",
    deleting: bool = False,
    server: str | None = "chat",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "prod",
        "labels": {"pagekeeper.dev/llmserver": server} if server else {},
    }
    if owner_kind is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": owner_kind,
                "name": "chat-6d8f",
                "uid": "u",
                "controller": True,
            }
        ]
    if deleting:
        metadata["deletionTimestamp"] = "2026-03-01T00:00:00Z"
    return {"metadata": metadata, "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def test_pod_state() -> None:
    assert pod_state(pod_body("a")) == PodState("a", "prod", "chat", True, False)
    assert pod_state(pod_body("b", ready="False", deleting=True)) == PodState(
        "b", "prod", "chat", False, True
    )
    # The label alone does not make a pod the server's: a ReplicaSet must control it.
    assert pod_state(pod_body("c", owner_kind=None)).server is None
    assert pod_state(pod_body("d", owner_kind="StatefulSet")).server is None
    assert pod_state(pod_body("e", server=None)).server is None


def record(pod: str) -> RemediationRecord:
    return RemediationRecord(
        time="2026-03-01T12:00:00Z", pod=pod, alert="A", action="evict", outcome="evicted"
    )


def test_bounded_history_keeps_the_most_recent() -> None:
    history = [record(p).model_dump(by_alias=True, exclude_none=True) for p in ("a", "b", "c")]
    assert [e["pod"] for e in bounded_history(history, record("d"), 3)] == ["b", "c", "d"]
    assert [e["pod"] for e in bounded_history([], record("d"), 3)] == ["d"]
    assert bounded_history([], record("d"), 3)[0] == {
        "time": "2026-03-01T12:00:00Z",
        "pod": "d",
        "alert": "A",
        "action": "evict",
        "outcome": "evicted",
        "message": "",
    }


def test_server_info_from_the_api_object() -> None:
    body = {
        "metadata": {"name": "chat", "namespace": "prod"},
        "spec": {
            "model": {"source": "/m"},
            "runtime": "vllm",
            "replicas": 3,
            "remediation": {"cooldownSeconds": 30},
        },
        "status": {"remediationHistory": [record("a").model_dump(by_alias=True)]},
    }
    mine = PodState("a", "prod", "chat", True, False)
    other = PodState("x", "prod", "other", True, False)
    info = server_info(body, [mine, other])
    assert info.state.num_desired == 3
    assert info.state.remediation.cooldown_seconds == 30
    assert info.state.pods == (mine,)
    assert info.history == (record("a"),)
    assert info.state.runtime == "vllm"
    bare_body = {
        "metadata": {"name": "chat", "namespace": "prod"},
        "spec": {"model": {"source": "/m"}},
    }
    bare = server_info(bare_body, [])
    assert (bare.state.num_desired, bare.state.remediation.cooldown_seconds, bare.history) == (
        1,
        600,
        (),
    )


class StubKube(Kube):
    """The adapter with its eviction answered by a fixed API response."""

    def __init__(self, error: ApiException | None) -> None:
        super().__init__(ApiClient())
        self.error = error
        self.evicted: list[tuple[str, str]] = []

    def evict(self, namespace: str, pod: str) -> None:
        self.evicted.append((namespace, pod))
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (None, EvictionOutcome.EVICTED),
        (ApiException(status=429, reason="Too Many Requests"), EvictionOutcome.PDB_BLOCKED),
        (ApiException(status=404, reason="Not Found"), EvictionOutcome.POD_GONE),
        (ApiException(status=500, reason="Internal Server Error"), EvictionOutcome.FAILED),
        (ApiException(status=403, reason="Forbidden"), EvictionOutcome.FAILED),
    ],
)
def test_evict_maps_api_answers(error: ApiException | None, outcome: EvictionOutcome) -> None:
    kube = StubKube(error)
    result, _ = asyncio.run(KubeClusterPort(kube).evict("prod", "chat-a"))
    assert result is outcome
    assert kube.evicted == [("prod", "chat-a")]


def test_event_about_a_server() -> None:
    body = event("prod", "chat", "u-1", "Warning", "EvictionBlocked", "no")
    assert body["metadata"] == {"generateName": "chat.", "namespace": "prod"}
    assert body["involvedObject"] == {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "name": "chat",
        "namespace": "prod",
        "uid": "u-1",
    }
    assert (body["type"], body["reason"], body["message"], body["count"]) == (
        "Warning",
        "EvictionBlocked",
        "no",
        1,
    )
    assert "uid" not in event("prod", "chat", None, "Normal", "PodEvicted", "")["involvedObject"]
