"""In-process server over a fake engine: /admin/defragment (auth, busy, CPU, CUDA-shaped
results from a fake allocator), /health answering while the step thread is busy, and the
bounded queue of --max-waiting-requests."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagekeeper_engine.async_engine import SWITCH_INTERVAL_S, AsyncLLMEngine
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.server.app import STATE, create_app
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


class BusyRunner(PagedFakeRunner):
    """Each step spends ~30 ms in Python, holding the GIL as a scheduling-heavy step does."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        started = time.perf_counter()
        x = 0
        while time.perf_counter() - started < 0.03:
            for _ in range(1000):
                x += 1
        return super().execute(out)


@pytest.fixture
def switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def serve_fake(runner: PagedFakeRunner, **config: Any) -> tuple[AsyncLLMEngine, Any]:
    engine, _ = make_engine(runner=runner)
    front = AsyncLLMEngine(engine)
    front.start()
    app = create_app(EngineConfig(model="fake", max_model_len=128, admin_token_env=ENV, **config))
    app[STATE].attach(front, CharTokenizer(), 128)  # type: ignore[arg-type]
    return front, app


async def consume(front: AsyncLLMEngine, request_id: str) -> None:
    async for _ in front.generate(request_id, [1, 2, 3], LONG):
        pass


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_defragment_requires_the_token(
    monkeypatch: pytest.MonkeyPatch, switch_interval: None
) -> None:
    async def main() -> list[tuple[int, str]]:
        front, app = serve_fake(PagedFakeRunner(256))
        seen = []
        async with TestClient(TestServer(app)) as client:
            monkeypatch.delenv(ENV, raising=False)
            response = await client.post("/admin/defragment", headers=auth())
            seen.append((response.status, (await response.json())["error"]["code"]))
            monkeypatch.setenv(ENV, TOKEN)
            for headers in ({}, {"Authorization": "Basic xyz"}, auth("wrong"), auth()):
                response = await client.post("/admin/defragment", headers=headers)
                seen.append((response.status, (await response.json())["error"]["code"]))
            response = await client.get("/admin/defragment", headers=auth())
            seen.append((response.status, (await response.json())["error"]["code"]))
        front.shutdown()
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
    monkeypatch: pytest.MonkeyPatch, switch_interval: None
) -> None:
    monkeypatch.setenv(ENV, TOKEN)
    allocator = FakeAllocator()
    runner = PagedFakeRunner(256, step_delay_s=0.01)
    runner.allocator_monitor = allocator

    async def main() -> None:
        front, app = serve_fake(runner)
        async with TestClient(TestServer(app)) as client:
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
            task = asyncio.create_task(consume(front, "busy"))
            while front.stats().num_running == 0:
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
        front.shutdown()

    run(main())
    assert allocator.num_releases == 2


def test_health_answers_promptly_while_the_engine_is_busy(switch_interval: None) -> None:
    sys.setswitchinterval(0.005)

    async def main() -> tuple[list[float], int, int]:
        front, app = serve_fake(BusyRunner(256))
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        async with TestClient(TestServer(app)) as client:
            tasks = [asyncio.create_task(consume(front, f"r{i}")) for i in range(2)]
            while front.stats().num_generation_tokens < 2:
                await asyncio.sleep(0.01)
            steps_before = front.stats().num_steps
            latencies = []
            for _ in range(20):
                started = time.perf_counter()
                response = await client.get("/health")
                latencies.append(time.perf_counter() - started)
                assert response.status == 200
                await asyncio.sleep(0.005)
            steps_after = front.stats().num_steps
            for task in tasks:
                task.cancel()
        front.shutdown()
        return latencies, steps_before, steps_after

    latencies, steps_before, steps_after = run(main())
    assert steps_after - steps_before >= 3, "the engine was meant to be stepping meanwhile"
    # A 30 ms step of Python does not hold /health back: the GIL changes hands every 0.5 ms.
    assert max(latencies) < 0.1, latencies


def test_max_waiting_requests_bounds_what_is_in_flight(switch_interval: None) -> None:
    async def main() -> list[tuple[int, str | None, str | None]]:
        front, app = serve_fake(
            PagedFakeRunner(256, step_delay_s=0.02), max_num_seqs=1, max_waiting_requests=1
        )
        assert app[STATE].max_num_in_flight == 2
        body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0}
        async with TestClient(TestServer(app)) as client:
            first = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in (0, 1)]
            while app[STATE].num_in_flight < 2:
                await asyncio.sleep(0.005)
            late = await client.post("/v1/completions", json=body)
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
        front.shutdown()
        return answers

    assert run(main()) == [(429, "1", "overloaded"), (200, None, "length"), (200, None, "length")]
