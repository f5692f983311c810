"""In-process front end over a fake core (`tests.engine.fake_core`): /admin/defragment (auth,
busy, CPU, CUDA-shaped results from a fake allocator, all through the core's messages) and the
bounded queue of --max-waiting-requests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.app import STATE, create_app
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.memory.allocator import AllocatorStats
from tests.engine.fake_core import FakeCore, fake_core
from tests.engine.fakes import CharTokenizer, PagedFakeRunner, make_engine

TOKEN = "s3cret-token"
ENV = "PAGEKEEPER_TEST_ADMIN_TOKEN"
LONG = SamplingParams(max_tokens=100, temperature=0.0)


class FakeAllocator:
    """Holds 900 bytes reserved, 600 allocated; releasing the cache frees 250."""

    def __init__(self) -> None:
        self.reserved = 900
        self.num_releases = 0

    def read(self) -> AllocatorStats:
        return AllocatorStats(self.reserved, 600, self.reserved - 600, 0, 0)

    def release_cached(self) -> int:
        self.num_releases += 1
        self.reserved -= 250
        return 250


def serve_fake(fake: FakeCore, **config: Any) -> Any:
    app = create_app(EngineConfig(model="fake", max_model_len=128, admin_token_env=ENV, **config))
    app[STATE].attach(fake.client, CharTokenizer())  # type: ignore[arg-type]
    return app


async def consume(client: CoreClient, request_id: str) -> None:
    async for _ in client.generate(request_id, [1, 2, 3], LONG):
        pass


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_defragment_requires_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> list[tuple[int, str]]:
        seen = []
        async with fake_core() as fake, TestClient(TestServer(serve_fake(fake))) as client:
            monkeypatch.delenv(ENV, raising=False)
            response = await client.post("/admin/defragment", headers=auth())
            seen.append((response.status, (await response.json())["error"]["code"]))
            monkeypatch.setenv(ENV, TOKEN)
            for headers in ({}, {"Authorization": "Basic xyz"}, auth("wrong"), auth()):
                response = await client.post("/admin/defragment", headers=headers)
                seen.append((response.status, (await response.json())["error"]["code"]))
            response = await client.get("/admin/defragment", headers=auth())
            seen.append((response.status, (await response.json())["error"]["code"]))
        return seen

    assert run(main()) == [
        (403, "admin_disabled"),
        (401, "unauthorized"),
        (401, "unauthorized"),
        (403, "forbidden"),
        (501, "no_cuda_allocator"),  # the right token, on the CPU
        (405, "method_not_allowed"),
    ]


def test_defragment_releases_when_idle_and_refuses_when_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, TOKEN)
    allocator = FakeAllocator()
    runner = PagedFakeRunner(256)
    runner.allocator_monitor = allocator

    async def main() -> None:
        engine, _ = make_engine(runner=runner)
        async with fake_core(engine) as fake, TestClient(TestServer(serve_fake(fake))) as client:
            front = fake.client
            response = await client.post("/admin/defragment", headers=auth())
            assert response.status == 200
            body = await response.json()
            seconds = body.pop("seconds")
            assert 0.0 <= seconds < 5.0
            assert body == {
                "defragmented": True,
                "num_running": 0,
                "bytes_freed": 250,
                "before": {
                    "reserved_bytes": 900,
                    "allocated_bytes": 600,
                    "fragmentation_bytes": 300,
                    "largest_free_block_bytes": 300,
                    "num_alloc_retries": 0,
                    "num_ooms": 0,
                },
                "after": {
                    "reserved_bytes": 650,
                    "allocated_bytes": 600,
                    "fragmentation_bytes": 50,
                    "largest_free_block_bytes": 50,
                    "num_alloc_retries": 0,
                    "num_ooms": 0,
                },
            }
            # After its first step the busy request takes one step per message the core gets
            # (an admin call, at last the abort): it runs through every call below.
            fake.hold_steps_until_messages(first_call=1)
            task = asyncio.create_task(consume(front, "busy"))
            while fake.engine.request_outputs.num_generation_tokens == 0:
                await asyncio.sleep(0.01)
            response = await client.post("/admin/defragment", headers=auth())
            assert response.status == 409
            assert response.headers["Retry-After"] == "5"
            assert (await response.json())["error"]["code"] == "busy"
            response = await client.post(
                "/admin/defragment", headers=auth(), json={"max_running": 1}
            )
            assert response.status == 200
            assert (await response.json())["num_running"] == 1
            response = await client.post(
                "/admin/defragment", headers=auth(), json={"max_running": -1}
            )
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "max_running"
            task.cancel()
            # the allocator reading reached the metrics through the step loop
            metrics = await (await client.get("/metrics")).text()
            assert 'pagekeeper_allocator_reserved_bytes{model_name="fake"}' in metrics

    run(main())
    assert allocator.num_releases == 2


def test_max_waiting_requests_bounds_what_is_in_flight() -> None:
    async def main() -> list[tuple[int, str | None, str | None]]:
        engine, _ = make_engine()
        config = {"max_num_seqs": 1, "max_waiting_requests": 1}
        async with fake_core(engine, EngineConfig(model="f", **config).max_num_in_flight) as fake:
            app = serve_fake(fake, **config)
            assert app[STATE].max_num_in_flight == 2
            # the first request's second step waits for the late one's answer: both of the
            # first two are in flight when it comes
            fake.hold_step_until(1, answered.is_set, "the late request's answer")
            return await overload(app)

    answered = threading.Event()

    async def overload(app: Any) -> list[tuple[int, str | None, str | None]]:
        body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0}
        async with TestClient(TestServer(app)) as client:
            first = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in (0, 1)]
            while app[STATE].num_in_flight < 2:
                await asyncio.sleep(0.005)
            late = await client.post("/v1/completions", json=body)
            answered.set()
            answers = [
                (late.status, late.headers.get("Retry-After"), (await late.json())["error"]["code"])
            ]
            for task in first:
                response = await task
                answers.append(
                    (response.status, None, (await response.json())["choices"][0]["finish_reason"])
                )
            metrics = await (await client.get("/metrics")).text()
            assert (
                'pagekeeper_requests_rejected_total{model_name="fake",reason="overloaded"} 1.0'
                in metrics
            )
        return answers

    assert run(main()) == [(429, "1", "overloaded"), (200, None, "length"), (200, None, "length")]
