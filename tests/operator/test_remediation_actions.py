"""Remediation's Kubernetes edge without a cluster: object mapping and API error handling."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
import pytest
from kubernetes.client import (
    ApiClient,
    V1ObjectMeta,
    V1OwnerReference,
    V1Pod,
    V1PodCondition,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.actions import (
    KubeClusterPort,
    bounded_history,
    pod_state,
    server_info,
)
from pagekeeper_operator.remediation.decide import PodState
from pagekeeper_operator.remediation.handlers import webhook_settings
from pagekeeper_operator.remediation.remediator import EvictionOutcome


def v1pod(
    name: str,
    *,
    owner_kind: str | None = "ReplicaSet",
    ready: str = "True",
    deleting: bool = False,
    server: str | None = "chat",
) -> V1Pod:
    owners = None
    if owner_kind is not None:
        owners = [
            V1OwnerReference(
                api_version="apps/v1", kind=owner_kind, name="chat-6d8f", uid="u", controller=True
            )
        ]
    return V1Pod(
        metadata=V1ObjectMeta(
            name=name,
            namespace="prod",
            labels={"pagekeeper.dev/llmserver": server} if server else {},
            owner_references=owners,
            deletion_timestamp=datetime(2026, 3, 1, tzinfo=UTC) if deleting else None,
        ),
        status=V1PodStatus(conditions=[V1PodCondition(type="Ready", status=ready)]),
    )


def test_pod_state() -> None:
    assert pod_state(v1pod("a")) == PodState("a", "prod", "chat", True, False)
    assert pod_state(v1pod("b", ready="False", deleting=True)) == PodState(
        "b", "prod", "chat", False, True
    )
    # The label alone does not make a pod the server's: a ReplicaSet must control it.
    assert pod_state(v1pod("c", owner_kind=None)).server is None
    assert pod_state(v1pod("d", owner_kind="StatefulSet")).server is None
    assert pod_state(v1pod("e", server=None)).server is None


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


class StubCore:
    def __init__(self, error: ApiException | None) -> None:
        self.error = error
        self.calls: list[tuple[str, str, Any]] = []

    def create_namespaced_pod_eviction(self, name: str, namespace: str, body: Any) -> None:
        self.calls.append((name, namespace, body))
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
    port = KubeClusterPort(ApiClient())
    stub = StubCore(error)
    port.core = stub  # type: ignore[assignment]
    result, _ = asyncio.run(port.evict("prod", "chat-a"))
    assert result is outcome
    [(name, namespace, body)] = stub.calls
    assert (name, namespace) == ("chat-a", "prod")
    assert (body.api_version, body.kind, body.metadata.name) == ("policy/v1", "Eviction", "chat-a")
    # No delete options: the pod's own grace period applies, and nothing is forced.
    assert body.delete_options is None


def test_webhook_settings(tmp_path: Path) -> None:
    token = tmp_path / "token"
    settings = webhook_settings(
        {"PAGEKEEPER_WEBHOOK_PORT": "9443", "PAGEKEEPER_WEBHOOK_TOKEN_FILE": str(token)}
    )
    assert (settings.port, settings.token_file, settings.tls_cert_file) == (9443, token, None)
    assert webhook_settings({}).token_file is None
    assert webhook_settings({}).port == 8443
    with pytest.raises(kopf.PermanentError, match="set both"):
        webhook_settings({"PAGEKEEPER_WEBHOOK_TLS_CERT_FILE": "/tls/crt"})
