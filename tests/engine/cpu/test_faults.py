"""Fatal errors pass every step handler; under tensor parallelism the runner turns every failure
of a step into one, at the launch and at the wait for its tokens; the fault-injection hook reads
its variable strictly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.faults import (
    INJECT_STEP_FAULT_ENV,
    INJECT_STEP_HANG_ENV,
    FatalEngineError,
    InjectedStepFaultError,
    StepFaultInjection,
    TensorParallelStepError,
    injected_fault_step,
)
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError
from pagekeeper_engine.runner.runner import ModelRunner
from pagekeeper_engine.runner.step_results import PendingStep
from tests.engine.checkpoints import make_runner, seq, tokens, write_checkpoint
from tests.engine.fakes import DoneStep, PagedFakeRunner, make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    "fatal",
    [TensorParallelStepError("tensor-parallel rank 1: a step failed"), EngineOutOfMemoryError("x")],
)
def test_a_fatal_error_is_never_one_failed_step(async_scheduling: bool, fatal: Exception) -> None:
    engine, runner = make_engine(async_scheduling=async_scheduling)
    engine.add_request("a", [1, 2, 3], GREEDY)
    runner.fail_next = fatal
    with pytest.raises(FatalEngineError) as info:
        for _ in range(4):  # under async scheduling the failure surfaces at the launch
            engine.step()
    assert info.value is fatal
    assert engine.stats().num_failed_steps == 0


class LostTokens:
    def result(self) -> RunnerOutput:
        raise TensorParallelStepError("tensor-parallel rank 0: a step failed")


class LosesItsSecondStep(PagedFakeRunner):
    """A runner whose second launched step fails while its tokens come back."""

    def launch(self, out: SchedulerOutput) -> DoneStep | LostTokens:  # type: ignore[override]
        done = super().launch(out)
        return LostTokens() if self.num_calls == 2 else done


def test_a_fatal_error_on_the_way_back_passes_the_settle() -> None:
    engine, _ = make_engine(async_scheduling=True, runner=LosesItsSecondStep(256))
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()  # launches the first step
    engine.step()  # launches the second, settles the first
    with pytest.raises(TensorParallelStepError):
        engine.step()  # settles the second
    assert engine.stats().num_failed_steps == 0


def test_an_ordinary_step_failure_still_fails_only_its_step() -> None:
    engine, runner = make_engine(async_scheduling=False)
    engine.add_request("a", [1, 2, 3], GREEDY)
    runner.fail_next = True
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.stats().num_failed_steps == 1


@pytest.mark.parametrize(
    ("value", "rank", "step"),
    [("", 0, None), ("1:3", 1, 3), ("1:3", 0, None), (" 0:1 ", 0, 1)],
)
def test_the_injection_hook(value: str, rank: int, step: int | None) -> None:
    assert injected_fault_step(rank, {INJECT_STEP_FAULT_ENV: value}) == step


@pytest.mark.parametrize("value", ["3", "a:1", "1:0", "1:-2", "1:x"])
def test_a_malformed_injection_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=INJECT_STEP_FAULT_ENV):
        injected_fault_step(0, {INJECT_STEP_FAULT_ENV: value})


def test_the_hang_hook_reads_its_own_variable() -> None:
    env = {INJECT_STEP_FAULT_ENV: "0:2", INJECT_STEP_HANG_ENV: "1:4"}
    assert injected_fault_step(1, env, INJECT_STEP_HANG_ENV) == 4
    assert injected_fault_step(0, env, INJECT_STEP_HANG_ENV) is None
    with pytest.raises(ValueError, match=INJECT_STEP_HANG_ENV):
        injected_fault_step(0, {INJECT_STEP_HANG_ENV: "4"}, INJECT_STEP_HANG_ENV)


def test_the_injection_hangs_in_the_named_step_only() -> None:
    hung_at: list[int] = []
    faults = StepFaultInjection(1, None, 3, hang=lambda: hung_at.append(faults.launched))
    for _ in range(5):
        faults.count()
    assert hung_at == [3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama")
    return path


def one_step() -> SchedulerOutput:
    return SchedulerOutput(seqs=[seq("a", tokens(5), 0, [1])], num_batched_tokens=5)


def as_rank_0_of_2(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> TensorParallelGroup:
    """The runner as rank 0 of two, its collectives suspended (the whole model is local)."""
    group = TensorParallelGroup(0, 2)
    monkeypatch.setattr(runner, "tp", group)
    return group


@pytest.mark.parametrize("size", [1, 2])
def test_an_injected_fault_is_fatal_only_under_tensor_parallelism(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setenv(INJECT_STEP_FAULT_ENV, "0:2")
    runner = make_runner(checkpoint)
    group = as_rank_0_of_2(runner, monkeypatch) if size == 2 else runner.tp
    with group.local_only():
        runner.execute(one_step())
        expected = TensorParallelStepError if size == 2 else InjectedStepFaultError
        with pytest.raises(expected, match="rank 0: fault injected in step 2"):
            runner.execute(one_step())
        runner.execute(one_step())  # one step only


def test_under_tensor_parallelism_tokens_that_fail_to_arrive_end_the_engine(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(checkpoint)
    group = as_rank_0_of_2(runner, monkeypatch)

    def lost(self: PendingStep) -> RunnerOutput:
        raise RuntimeError("the copy to the host failed")

    monkeypatch.setattr(PendingStep, "result", lost)
    with group.local_only(), pytest.raises(TensorParallelStepError) as info:
        runner.execute(one_step())
    assert str(info.value) == (
        "tensor-parallel rank 0: a step failed (RuntimeError: the copy to the host failed); "
        "the other ranks cannot go on without it"
    )
