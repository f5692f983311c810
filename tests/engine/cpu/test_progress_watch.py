"""The progress watchdog: the pure decision, a loop that marks its idle turns, and a loop stuck
in a step found from the watchdog's own thread, which writes the stuck termination message,
tells the front end (`Fatal`, with the reason on /ready) and ends the process."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.engine_process import StuckLoopHandler
from pagekeeper_engine.frontend.app import STATE, create_app
from pagekeeper_engine.frontend.client import EngineDeadError
from pagekeeper_engine.progress_watch import LoopProgress, ProgressWatchdog, find_stuck
from pagekeeper_engine.stuck import StuckReport, parse_stuck_message
from tests.engine.fake_core import collect, fake_core
from tests.engine.fakes import CharTokenizer, PagedFakeRunner, make_engine

STUCK_TIMEOUT_S = 2.0
# a bound on finding it, not a speed: the timeout plus a generous margin for a busy machine
FOUND_WITHIN_S = STUCK_TIMEOUT_S + 30.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_a_loop_is_stuck_from_the_timeout_on() -> None:
    progress = LoopProgress(last_turn_s=100.0, num_running=3, num_waiting=2)
    assert find_stuck(progress, 101.9, 2.0) is None
    assert find_stuck(progress, 102.0, 2.0) == StuckReport(
        2.0,
        3,
        2,
        "the engine's step loop completed no step for 2.0 s with 3 running and 2 waiting "
        "(--stuck-timeout 2)",
    )


def test_time_before_watching_began_never_counts() -> None:
    progress = LoopProgress(last_turn_s=100.0, num_running=1, num_waiting=0)
    assert find_stuck(progress, 105.0, 2.0, since_s=104.0) is None
    report = find_stuck(progress, 106.5, 2.0, since_s=104.0)
    assert report is not None and report.last_step_age_s == 2.5


def test_the_watchdog_reports_once_on_its_own_thread() -> None:
    reports: list[tuple[StuckReport, str]] = []
    found = threading.Event()

    def on_stuck(report: StuckReport) -> None:
        reports.append((report, threading.current_thread().name))
        found.set()

    # started at 0 s, and 10 s past the only mark at the first look: stuck
    clock = itertools.chain([0.0], itertools.repeat(10.0))
    watchdog = ProgressWatchdog(
        2.0, lambda: LoopProgress(0.0, 1, 0), on_stuck, clock=lambda: next(clock)
    )
    assert found.wait(FOUND_WITHIN_S)
    watchdog.thread.join(FOUND_WITHIN_S)
    assert not watchdog.thread.is_alive()
    assert [(r.last_step_age_s, r.num_running, name) for r, name in reports] == [
        (10.0, 1, "progress-watch")
    ]


def test_a_stopped_watchdog_never_reports() -> None:
    watchdog = ProgressWatchdog(
        60.0, lambda: LoopProgress(0.0, 0, 0), lambda r: pytest.fail(str(r)), clock=lambda: 1.0
    )
    watchdog.stop()
    watchdog.thread.join(FOUND_WITHIN_S)
    assert not watchdog.thread.is_alive()


def test_an_idle_loop_marks_its_turns() -> None:
    async def main() -> None:
        async with fake_core() as fake:
            first = fake.core.progress()
            assert (first.num_running, first.num_waiting) == (0, 0)

            def turned() -> bool:
                return fake.core.progress().last_turn_s > first.last_turn_s

            while not turned():  # an idle turn ends at most every HEARTBEAT_INTERVAL_S
                await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(main(), FOUND_WITHIN_S))


class HangingRunner(PagedFakeRunner):
    """Its second step does not return until the test releases it, as a hung collective."""

    def __init__(self) -> None:
        super().__init__(64)
        self.inside = threading.Event()
        self.release = threading.Event()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.num_calls == 1:
            self.inside.set()
            self.release.wait()  # the test releases it in every case
        return super().execute(out)


def test_a_loop_stuck_in_a_step_is_ended_with_the_stuck_message(tmp_path: Path) -> None:
    runner = HangingRunner()
    engine, _ = make_engine(runner=runner, async_scheduling=False)
    log = tmp_path / "termination-log"
    config = EngineConfig(
        model="fake", device="cpu", termination_log_path=str(log), stuck_timeout=STUCK_TIMEOUT_S
    )
    exits: list[int] = []
    ended = threading.Event()

    def exit(code: int) -> None:
        exits.append(code)
        ended.set()

    async def main() -> tuple[str | None, tuple[int, int, object]]:
        async with fake_core(engine) as fake:
            app = create_app(EngineConfig(model="fake", max_model_len=128))
            app[STATE].attach(fake.client, CharTokenizer())  # type: ignore[arg-type]
            http = TestClient(TestServer(app))
            await http.start_server()
            loop_thread = fake.thread.ident
            assert loop_thread is not None
            handler = StuckLoopHandler(config, fake.addresses, 1, loop_thread, exit=exit)
            watchdog = ProgressWatchdog(STUCK_TIMEOUT_S, fake.core.progress, handler)
            request = asyncio.ensure_future(collect(fake.client, "r", [1, 2, 3], GREEDY))
            try:
                before = (await http.get("/ready")).status
                assert await asyncio.to_thread(runner.inside.wait, FOUND_WITHIN_S)
                assert await asyncio.to_thread(ended.wait, FOUND_WITHIN_S)
                # the front end hears of it while the loop is still stuck
                with pytest.raises(EngineDeadError, match="stuck: the engine's step loop"):
                    await asyncio.wait_for(request, FOUND_WITHIN_S)
                assert not fake.client.is_alive()
                ready = await http.get("/ready")
                return fake.client.dead_reason, (before, ready.status, await ready.json())
            finally:
                watchdog.stop()
                runner.release.set()
                await http.close()

    reason, (ready_before, ready_status, ready_body) = asyncio.run(main())
    assert exits == [1]
    report = parse_stuck_message(log.read_text())
    assert report is not None, log.read_text()
    assert (report.num_running, report.num_waiting) == (1, 0)
    assert STUCK_TIMEOUT_S <= report.last_step_age_s < FOUND_WITHIN_S
    assert reason == f"the engine core gave up: stuck: {report.detail}"
    assert (ready_before, ready_status) == (200, 503)
    assert ready_body == {"status": "engine loop is not running", "reason": reason}
    assert report.detail.startswith("the engine's step loop completed no step for ")
    assert report.detail.endswith(" s with 1 running and 0 waiting (--stuck-timeout 2)")
