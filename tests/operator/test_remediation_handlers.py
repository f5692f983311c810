"""The startup handler serves the webhook from the settings, and the cleanup handler stops it."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest

from pagekeeper_operator.controllers import remediation_handlers as handlers
from pagekeeper_operator.policy.adaptive import OOMClassification
from pagekeeper_operator.remediation.remediator import Remediator
from tests.operator.remediation_fakes import alert_json, message_json
from tests.operator.servers import server_body

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_webhook_served_from_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    port = free_port()
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("PAGEKEEPER_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("PAGEKEEPER_WEBHOOK_TOKEN_FILE", str(token))
    url = f"http://127.0.0.1:{port}"
    payload = json.dumps(message_json(alert_json("chat-a")))

    async def scenario() -> None:
        memo = kopf.Memo()
        await handlers.start_remediation(memo=memo)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/healthz") as response:
                    assert response.status == 200
                async with session.post(f"{url}/alertmanager", data=payload) as response:
                    assert response.status == 401
                auth = {"Authorization": "Bearer tok-123"}
                # Authenticated and valid, but the API server is unreachable: 500, so
                # Alertmanager delivers it again later.
                async with session.post(
                    f"{url}/alertmanager", data=payload, headers=auth
                ) as response:
                    assert response.status == 500
        finally:
            await handlers.stop_remediation(memo=memo)
        runtime = memo[handlers.MEMO_KEY]
        assert runtime.retry_task is not None and runtime.retry_task.cancelled()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz"):
                pass

    asyncio.run(scenario())


def test_empty_token_file_refuses_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("PAGEKEEPER_WEBHOOK_TOKEN_FILE", str(token))
    with pytest.raises(kopf.PermanentError, match="is empty"):
        asyncio.run(handlers.start_remediation(memo=kopf.Memo()))


class _StatusPort:
    """The part of the cluster port the OOM response uses: one LLMServer's object."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.events: list[str] = []

    async def update_server_status(
        self, namespace: str, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> dict[str, Any] | None:
        before = copy.deepcopy(self.body)
        patch = change(before)
        if patch is None:
            return None
        self.body["status"] = {**self.body.get("status", {}), **patch}
        return before

    async def emit_event(
        self, namespace: str, server: str, type_: str, reason: str, message: str
    ) -> None:
        self.events.append(reason)


@pytest.mark.parametrize(
    ("classification", "adaptive", "reconciled", "event"),
    [
        (OOMClassification("gpu", "runtime", "step failed"), {}, True, "PolicySteppedDown"),
        (OOMClassification("gpu", "startup", ""), {}, False, "GPUOutOfMemoryAtStartup"),
        (
            OOMClassification("gpu", "runtime", ""),
            {"enabled": False},
            False,
            "GPUOutOfMemoryAtRuntime",
        ),
    ],
)
def test_a_step_down_reconciles_the_server_at_once(
    classification: OOMClassification, adaptive: dict[str, Any], reconciled: bool, event: str
) -> None:
    body = server_body()
    body["metadata"]["resourceVersion"] = "7"
    body["spec"]["remediation"] = {"adaptive": adaptive}
    port = _StatusPort(body)
    calls: list[tuple[str, str, float]] = []

    async def reconcile_server(namespace: str, name: str) -> None:
        # Reconciles after the lowered policy is in status, so it renders that one.
        policy = port.body["status"].get("effectiveMemoryPolicy", {})
        calls.append((namespace, name, policy.get("gpuMemoryUtilization", 0.0)))

    runtime = handlers.RemediationRuntime(
        port=port,  # type: ignore[arg-type]
        remediator=Remediator(port),  # type: ignore[arg-type]
        reconcile_server=reconcile_server,
    )
    asyncio.run(handlers._respond(runtime, "ml", "qwen", "qwen-a", classification, "k1", "t"))
    assert port.events == [event]
    assert calls == ([("ml", "qwen", 0.85)] if reconciled else [])


def test_an_oom_already_recorded_is_not_answered_twice() -> None:
    body = server_body()
    port = _StatusPort(body)

    async def reconcile_server(namespace: str, name: str) -> None:
        raise AssertionError("nothing to reconcile")

    runtime = handlers.RemediationRuntime(
        port=port,  # type: ignore[arg-type]
        remediator=Remediator(port),  # type: ignore[arg-type]
        reconcile_server=reconcile_server,
    )
    oom = OOMClassification("gpu", "startup", "")
    asyncio.run(handlers._respond(runtime, "ml", "qwen", "qwen-a", oom, "k1", "t"))
    asyncio.run(handlers._respond(runtime, "ml", "qwen", "qwen-a", oom, "k1", "t"))
    assert port.events == ["GPUOutOfMemoryAtStartup"]
    assert len(port.body["status"]["remediationHistory"]) == 1
