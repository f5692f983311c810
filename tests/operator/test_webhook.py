"""The Alertmanager webhook receiver over real HTTP (aiohttp's test server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.webhook import is_authorized, make_app
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


def test_handler_failure_is_500_so_alertmanager_retries() -> None:
    async def failing(message: WebhookMessage) -> dict[str, Any]:
        raise ConnectionError("API server unreachable")

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        assert response.status == 500

    run(make_app(lambda: TOKEN, failing), scenario)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ApiException(status=403, reason="Forbidden"), 422),
        (ApiException(status=422, reason="Unprocessable Entity"), 422),
        (ValueError("Invalid isoformat string: 'yesterday'"), 422),
        (ApiException(status=409, reason="Conflict"), 500),
        (ApiException(status=503, reason="Service Unavailable"), 500),
        (ConnectionError("API server unreachable"), 500),
    ],
)
def test_a_failure_no_retry_can_fix_is_4xx_and_the_rest_5xx(error: Exception, status: int) -> None:
    async def failing(message: WebhookMessage) -> dict[str, Any]:
        raise error

    async def scenario(client: TestClient[web.Request, web.Application]) -> None:
        response = await client.post("/alertmanager", data=body("chat-a"), headers=AUTH)
        answer = await response.json()
        assert (response.status, answer.get("retry", True)) == (status, status >= 500)

    run(make_app(lambda: TOKEN, failing), scenario)


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
