"""The Alertmanager webhook receiver over real HTTP (aiohttp's test server)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.failures import UnreadableDataError
from pagekeeper_operator.remediation.actions import server_info
from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.port import ServerInfo
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.webhook import is_authorized, make_app
from pagekeeper_operator.timestamps import TimestampError
from tests.operator.remediation_fakes import Clock, FakeCluster, alert_json, message_json

TOKEN = "s3cret-token-value"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Recorder:
    def __init__(self) -> None:
        self.messages: list[WebhookMessage] = []

    async def __call__(self, message: WebhookMessage) -> dict[str, Any]:
        self.messages.append(message)
        return {"received": len(message.alerts)}


Scenario = Callable[[TestClient[web.Request, web.Application]], Awaitable[None]]


def run(app: web.Application, scenario: Scenario) -> None:
    async def main() -> None:
        async with TestClient(TestServer(app)) as client:
            await scenario(client)

    asyncio.run(main())


def body(*pods: str) -> str:
    return json.dumps(message_json(*(alert_json(pod) for pod in pods)))


def test_is_authorized() -> None:
    assert is_authorized(f"Bearer {TOKEN}", TOKEN)
    assert is_authorized(f"bearer {TOKEN}", TOKEN)
    assert not is_authorized(None, TOKEN)
    assert not is_authorized(f"Basic {TOKEN}", TOKEN)
    assert not is_authorized(f"Bearer {TOKEN}x", TOKEN)
    assert not is_authorized(f"Bearer {TOKEN[:-1]}", TOKEN)
    # No configured token authorizes nothing, not even an empty one.
    assert not is_authorized("Bearer ", "")
    assert not is_authorized("Bearer", "")


def test_missing_or_wrong_token_is_401() -> None:
    recorder = Recorder()

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = await client.post("/alertmanager", data=body("chat-a"), headers=headers)
            assert response.status == 401
            assert await response.json() == {"error": "missing or wrong bearer token"}

    run(make_app(lambda: TOKEN, recorder), scenario)
    assert recorder.messages == []


def test_oversize_body_is_413() -> None:
    recorder = Recorder()

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        small = body("chat-a")
        assert len(small) < 2048
        response = await client.post("/alertmanager", data=small, headers=AUTH)
        assert response.status == 200
        big = body(*(f"chat-{i}" for i in range(20)))
        assert len(big) > 2048
        response = await client.post("/alertmanager", data=big, headers=AUTH)
        assert response.status == 413
        assert await response.json() == {"error": "body larger than 2048 bytes"}

        # Chunked, with no Content-Length to refuse it by: the read itself is bounded.
        async def chunks() -> Any:
            for start in range(0, len(big), 512):
                yield big[start : start + 512].encode()

        response = await client.post("/alertmanager", data=chunks(), headers=AUTH)
        assert response.status == 413

    run(make_app(lambda: TOKEN, recorder, max_body_bytes=2048), scenario)
    assert len(recorder.messages) == 1


def test_malformed_json_and_schema_are_400() -> None:
    recorder = Recorder()

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data="{not json", headers=AUTH)
        assert response.status == 400
        assert (await response.json())["error"].startswith("body is not JSON: ")

        response = await client.post("/alertmanager", data=b"\xff\xfe", headers=AUTH)
        assert response.status == 400

        wrong = message_json(alert_json("chat-a"))
        wrong["version"] = "3"
        del wrong["alerts"][0]["fingerprint"]
        wrong["alerts"][0]["startsAt"] = "yesterday"
        response = await client.post("/alertmanager", data=json.dumps(wrong), headers=AUTH)
        assert response.status == 400
        payload = await response.json()
        assert payload["error"] == "not an Alertmanager notification"
        assert sorted(f["field"] for f in payload["fields"]) == [
            "alerts.0.fingerprint",
            "alerts.0.startsAt",
            "version",
        ]

        response = await client.post("/alertmanager", data="[]", headers=AUTH)
        assert response.status == 400

        naive = message_json(alert_json("chat-a"))
        naive["alerts"][0]["startsAt"] = "2026-03-01T11:55:00"
        response = await client.post("/alertmanager", data=json.dumps(naive), headers=AUTH)
        assert response.status == 400
        assert [f["field"] for f in (await response.json())["fields"]] == ["alerts.0.startsAt"]

    run(make_app(lambda: TOKEN, recorder), scenario)
    assert recorder.messages == []


def test_repeats_and_resolved_are_200_and_act_once() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"])
    remediator = Remediator(cluster, clock=Clock())

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        decisions = []
        for data in (body("chat-a"), body("chat-a")):
            response = await client.post("/alertmanager", data=data, headers=AUTH)
            assert response.status == 200
            decisions.append((await response.json())["decisions"])
        resolved = json.dumps(message_json(alert_json("chat-a", status="resolved")))
        for _ in range(2):
            response = await client.post("/alertmanager", data=resolved, headers=AUTH)
            assert response.status == 200
            decisions.append((await response.json())["decisions"])
        assert [(d[0]["verdict"], d[0]["reason"]) for d in decisions] == [
            ("evict", None),
            ("skip", "duplicate"),
            ("skip", "resolved"),
            ("skip", "resolved"),
        ]

    run(make_app(lambda: TOKEN, remediator.handle), scenario)
    assert cluster.eviction_attempts == ["chat-a"]


RETRIED = {"error": "could not handle the notification; it will be retried"}


def refused(reason: str) -> dict[str, Any]:
    return {"error": f"the notification cannot be handled: {reason}", "retry": False}


@pytest.mark.parametrize(
    ("error", "status", "answer"),
    [
        (ApiException(400, "Bad Request"), 422, refused("the API server answered 400 Bad Request")),
        (ApiException(403, "Forbidden"), 422, refused("the API server answered 403 Forbidden")),
        (ApiException(404, "Not Found"), 422, refused("the API server answered 404 Not Found")),
        (
            ApiException(422, "Unprocessable Entity"),
            422,
            refused("the API server answered 422 Unprocessable Entity"),
        ),
        (
            TimestampError("unreadable time stamp 'yesterday' (RFC 3339 expected)"),
            422,
            refused("TimestampError: unreadable time stamp 'yesterday' (RFC 3339 expected)"),
        ),
        (
            UnreadableDataError("LLMServer prod/chat cannot be read: spec.replicas"),
            422,
            refused("UnreadableDataError: LLMServer prod/chat cannot be read: spec.replicas"),
        ),
        # An expired service-account token: the client reads the refreshed one again.
        (ApiException(401, "Unauthorized"), 500, RETRIED),
        (ApiException(408, "Request Timeout"), 500, RETRIED),
        (ApiException(409, "Conflict"), 500, RETRIED),
        (ApiException(410, "Gone"), 500, RETRIED),
        (ApiException(429, "Too Many Requests"), 500, RETRIED),
        (ApiException(503, "Service Unavailable"), 500, RETRIED),
        (ConnectionError("API server unreachable"), 500, RETRIED),
        # Bugs in the operator's own code say nothing about the alert: retried, never dropped.
        (ValueError("invalid literal for int() with base 10: 'x'"), 500, RETRIED),
        (KeyError("spec"), 500, RETRIED),
        (RuntimeError("status of prod/chat kept changing; not written"), 500, RETRIED),
    ],
)
def test_a_failure_no_retry_can_fix_is_422_and_the_rest_500(
    error: Exception, status: int, answer: dict[str, Any]
) -> None:
    async def failing(message: WebhookMessage) -> dict[str, Any]:
        raise error

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        assert (response.status, await response.json()) == (status, answer)

    run(make_app(lambda: TOKEN, failing), scenario)


class BuggyCluster(FakeCluster):
    """Reading the server fails `num_bugs` times with an exception no rule foresaw."""

    num_bugs: int = 1

    async def read_server(self, namespace: str, name: str) -> ServerInfo | None:
        if self.num_bugs > 0:
            self.num_bugs -= 1
            raise ValueError("a bug: not a property of the alert")
        return await super().read_server(namespace, name)


def test_an_unexpected_exception_in_the_handler_is_500_logged_and_the_resend_acts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = BuggyCluster(["chat-a", "chat-b"])
    remediator = Remediator(cluster, clock=Clock())

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        assert (response.status, await response.json()) == (500, RETRIED)
        assert cluster.eviction_attempts == []
        # Alertmanager re-sends a 5xx; this time the handler passes.
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        assert response.status == 200
        decisions = (await response.json())["decisions"]
        assert [(d["pod"], d["verdict"]) for d in decisions] == [("chat-a", "evict")]

    with caplog.at_level(logging.ERROR, logger="pagekeeper_operator.remediation.webhook"):
        run(make_app(lambda: TOKEN, remediator.handle), scenario)
    assert cluster.eviction_attempts == ["chat-a"]
    (record,) = [r for r in caplog.records if r.name == "pagekeeper_operator.remediation.webhook"]
    assert record.getMessage() == (
        'could not handle notification {}:{alertname="PagekeeperKVCacheSaturated"} (retryable)'
    )
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_unreadable_stored_data_in_the_handler_is_422() -> None:
    """A stored LLMServer whose history holds a time its models refuse (written before the CRD
    said `format: date-time`): no retry can read it, so Alertmanager is told 4xx."""
    earlier = alert_json("chat-b", fingerprint="earlier")
    stored = {
        "metadata": {"name": "chat", "namespace": "prod", "generation": 1},
        "spec": {"model": {"source": "/models/qwen3-0.6b"}},
        "status": {"remediationHistory": [{
            "time": "yesterday", "pod": "chat-b", "alert": "PagekeeperKVCacheSaturated",
            "action": "evict", "outcome": "evicted", "fingerprint": "earlier",
            "alertStartsAt": earlier["startsAt"],
        }]},
    }  # fmt: skip

    class StoredCluster(FakeCluster):
        async def read_server(self, namespace: str, name: str) -> ServerInfo | None:
            return server_info(stored, tuple(self.pods.values()))

    cluster = StoredCluster(["chat-a", "chat-b"])
    remediator = Remediator(cluster, clock=Clock())

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        answer = await response.json()
        assert response.status == 422
        assert "LLMServer prod/chat cannot be read" in json.dumps(answer)
        assert "status.remediationHistory.0.time" in json.dumps(answer)
        assert "unreadable time stamp 'yesterday'" in json.dumps(answer)

    run(make_app(lambda: TOKEN, remediator.handle), scenario)
    assert cluster.eviction_attempts == []


def test_rotated_token_applies_and_healthz_needs_none() -> None:
    tokens = [TOKEN]
    recorder = Recorder()

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.get("/healthz")
        assert response.status == 200
        assert await response.json() == {"status": "ok"}
        tokens[0] = "rotated"
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        assert response.status == 401
        rotated = {"Authorization": "Bearer rotated"}
        response = await client.post("/alertmanager", data=body("chat-a"), headers=rotated)
        assert response.status == 200
        assert await response.json() == {"received": 1}

    run(make_app(lambda: tokens[0], recorder), scenario)
    assert len(recorder.messages) == 1
