"""The engine core's process body (`engine_process._serve`) over a fake runner: the handshake a
front end gets (after the process froze its start-up heap), and an out-of-memory give-up that
writes the termination log and exits 1. What it does when a tensor-parallel rank dies: the loop
gives up with `Fatal`, and a loop stuck in a step is ended around it; the termination message
keeps a failed rank's own."""

from __future__ import annotations

import asyncio
import gc
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from pagekeeper_engine import engine_process
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import resolve_limits
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.engine_process import RankFailureHandler, report_fatal
from pagekeeper_engine.faults import FatalEngineError, RankFailedError, TensorParallelStepError
from pagekeeper_engine.frontend.client import EngineDeadError
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.heap import thaw_heap
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError
from pagekeeper_engine.messages import CoreAddresses
from pagekeeper_engine.runner import runner as runner_module
from tests.engine.fake_core import collect, fake_core
from tests.engine.fakes import EOS, CharTokenizer, PagedFakeRunner, make_engine

JOIN_TIMEOUT_S = 30.0


class OutOfMemoryRunner(PagedFakeRunner):
    """A fake runner with what the process reads off a real one; every step runs out of memory."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(64)
        self.oom_at_steps = set(range(1000))
        self.limits = resolve_limits(config, 128)
        self.block_size = config.block_size
        self.eos_token_ids = frozenset({EOS})
        self.kv_cache_dtype = "torch.float32"
        self.memory_budget_bytes = [{"weights": 100, "kv_cache": 200}]

    def check_sampling(self, params: SamplingParams) -> None:
        """Every request's parameters can be honoured (no schema to compile)."""


def test_the_core_process_gives_up_writes_the_termination_log_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(runner_module, "ModelRunner", OutOfMemoryRunner)
    log = tmp_path / "termination-log"
    config = EngineConfig(
        model="fake",
        device="cpu",
        block_size=4,
        max_consecutive_ooms=1,
        termination_log_path=str(log),
    )
    codes: list[int] = []
    frozen: list[int] = []

    async def main(directory: str) -> Any:
        addresses = CoreAddresses(directory)
        client = CoreClient(addresses, 0, CharTokenizer().decode_batch)
        core = threading.Thread(
            target=lambda: codes.append(engine_process._serve(config, addresses, 1, lambda: True)),
            daemon=True,
        )
        core.start()
        try:
            ready = await client.wait_ready()
            frozen.append(gc.get_freeze_count())  # this process is the core's here
            with pytest.raises(EngineDeadError, match="gave up: 2 out-of-memory errors"):
                async for _ in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                    pass
            await asyncio.to_thread(core.join, JOIN_TIMEOUT_S)
            return ready
        finally:
            await client.close()

    thaw_heap()
    try:
        with tempfile.TemporaryDirectory(prefix="pk-core-") as directory:
            ready = asyncio.run(main(directory))
    finally:
        thaw_heap()
    assert codes == [1]
    assert frozen[0] > 1000  # the modules and objects of its start-up
    assert (ready.limits.max_model_len, ready.block_size, ready.num_gpu_blocks) == (128, 4, 64)
    assert ready.memory_budget_bytes == [{"weights": 100, "kv_cache": 200}]
    assert ready.kv_cache_dtype == "float32"
    assert log.read_text().startswith(
        "pagekeeper-oom kind=host phase=runtime detail=2 out-of-memory errors in a row"
    )


KILLED = "tensor-parallel rank 1 (pid 7) was killed by signal 9"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def fatal_config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(
        model="fake", device="cpu", termination_log_path=str(tmp_path / "termination-log")
    )


def test_a_dead_rank_ends_an_idle_loop_with_fatal(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[int], str | None]:
        async with fake_core() as fake:
            exits: list[int] = []
            handler = RankFailureHandler(
                fatal_config(tmp_path), fake.addresses, 1, grace_s=JOIN_TIMEOUT_S, exit=exits.append
            )
            handler.attach(fake.core)
            calling = asyncio.ensure_future(asyncio.to_thread(handler, RankFailedError(KILLED)))
            await asyncio.wait_for(fake.client.died.wait(), JOIN_TIMEOUT_S)
            await asyncio.to_thread(fake.thread.join, JOIN_TIMEOUT_S)
            handler.finished.set()  # as the process's own path does when it ends
            await calling
            return fake.exit_codes, exits, fake.client.dead_reason

    codes, exits, reason = asyncio.run(main())
    assert codes == [1]
    assert exits == []  # the loop got there: the process ends its own way
    assert reason == f"the engine core gave up: {KILLED}"


class StuckRunner(PagedFakeRunner):
    """Rank 0 inside a collective a dead rank never joins: its step returns only when released."""

    def __init__(self) -> None:
        super().__init__(64)
        self.inside = threading.Event()
        self.release = threading.Event()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.inside.set()
        self.release.wait()  # the test releases it in every case
        return super().execute(out)


def test_a_dead_rank_ends_the_process_around_a_loop_stuck_in_a_step(tmp_path: Path) -> None:
    runner = StuckRunner()
    engine, _ = make_engine(runner=runner)
    config = fatal_config(tmp_path)

    async def main() -> list[int]:
        async with fake_core(engine) as fake:
            request = asyncio.ensure_future(collect(fake.client, "r", [1, 2, 3], GREEDY))
            try:
                assert await asyncio.to_thread(runner.inside.wait, JOIN_TIMEOUT_S)
                exits: list[int] = []
                handler = RankFailureHandler(
                    config, fake.addresses, 1, grace_s=0.1, exit=exits.append
                )
                handler.attach(fake.core)
                await asyncio.to_thread(handler, RankFailedError(KILLED))
                # the front end hears of it while the loop is still stuck
                with pytest.raises(EngineDeadError, match=r"gave up: tensor-parallel rank 1 "):
                    await asyncio.wait_for(request, JOIN_TIMEOUT_S)
            finally:
                runner.release.set()
            await asyncio.to_thread(fake.thread.join, JOIN_TIMEOUT_S)
            return exits

    assert asyncio.run(main()) == [1]
    assert Path(config.termination_log_path).read_text() == f"engine core failed: {KILLED}\n"


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RankFailedError(KILLED), f"engine core failed: {KILLED}\n"),
        (RankFailedError("rank 1 failed", wrote_termination_message=True), "left alone\n"),
        (
            TensorParallelStepError("rank 0: a step failed"),
            "engine core failed: rank 0: a step failed\n",
        ),
        (
            EngineOutOfMemoryError("3 out-of-memory errors in a row"),
            "pagekeeper-oom kind=host phase=runtime detail=3 out-of-memory errors in a row\n",
        ),
    ],
)
def test_the_termination_message_of_a_fatal_error(
    tmp_path: Path, error: FatalEngineError, message: str
) -> None:
    config = fatal_config(tmp_path)
    Path(config.termination_log_path).write_text("left alone\n")  # as the failed rank wrote
    report_fatal(config, error)
    assert Path(config.termination_log_path).read_text() == message
