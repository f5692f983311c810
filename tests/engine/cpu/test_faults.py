"""Fatal errors pass every step handler; the fault-injection hook reads its variable strictly."""

from __future__ import annotations

import pytest

from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.faults import (
    INJECT_STEP_FAULT_ENV,
    FatalEngineError,
    TensorParallelStepError,
    injected_fault_step,
)
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError
from tests.engine.fakes import make_engine

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
