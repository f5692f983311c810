"""A device out-of-memory error inside a step: the engine shrinks the step, preempts, retries,
and gives up only when it repeats; the requests end with the tokens they would have had."""

from __future__ import annotations

import pytest

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError
from pagekeeper_engine.memory.step_budget import StepTokenBudget
from tests.engine.fakes import make_engine, rollout, run_all, tokens_of

PROMPTS = {
    "a": [3, 1, 4],
    "b": list(range(1, 15)),
    "c": list(range(20, 37)),
    "d": [7] * 5,
    "e": [2, 7, 1, 8, 2, 8],
    "f": [9, 9, 8],
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
EXPECTED = {rid: rollout(prompt, 12) for rid, prompt in PROMPTS.items()}


def test_step_budget_halves_to_its_floor_and_doubles_back_after_clean_steps() -> None:
    budget = StepTokenBudget(ceiling=100, floor=16, restore_after=3)
    assert (budget.current, budget.is_reduced) == (100, False)
    assert [budget.on_oom() for _ in range(4)] == [50, 25, 16, 16]
    assert budget.num_consecutive_ooms == 4
    assert [budget.on_clean_step() for _ in range(7)] == [16, 16, 32, 32, 32, 64, 64]
    assert budget.num_consecutive_ooms == 0
    assert budget.on_oom() == 32  # the clean-step count starts again
    assert [budget.on_clean_step() for _ in range(6)] == [32, 32, 64, 64, 64, 100]
    assert budget.is_reduced is False
    budget.on_oom()
    budget.restore()
    assert (budget.current, budget.num_clean_steps) == (100, 0)
    assert StepTokenBudget(ceiling=8).floor == 8  # never above the configured budget


def test_oom_steps_are_retried_smaller_and_tokens_are_unchanged() -> None:
    engine, runner = make_engine(budget=32)
    engine.step_budget = StepTokenBudget(ceiling=32, floor=2, restore_after=5)
    runner.oom_at_steps = {4, 5, 6}  # three in a row, once every sequence is decoding
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = run_all(engine)
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == EXPECTED
    stats = engine.stats()
    assert dict(stats.num_oom_events) == {"step": 3, "swap": 0, "startup": 0}
    assert stats.num_requests_success == {"stop": 0, "length": 6, "abort": 0}
    assert stats.num_failed_steps == 0
    # 32 -> 16 -> 8 -> 4 tokens: 6 running sequences, the two newest of the step preempted
    assert stats.num_recompute_preemptions == 2
    # Failed steps record nothing. After them: 5 clean steps of 4 decodes; then 8 tokens, room
    # for the preempted pair to come back (prefix-cache hits make their recompute short).
    assert runner.num_batched_tokens == [32, 18, 6, 6, 4, 4, 4, 4, 4, 7, 6, 6, 4, 2, 2, 2, 2, 2]
    # 14 clean steps since: doubled after 5 and after 10, one short of the next doubling
    assert (stats.step_token_budget, stats.max_step_token_budget) == (16, 32)


def test_repeated_ooms_give_up_with_the_reason() -> None:
    engine, runner = make_engine(budget=32, max_consecutive_ooms=3)
    runner.oom_at_steps = set(range(100))
    engine.add_request("a", PROMPTS["a"], GREEDY)
    for _ in range(3):
        assert engine.step() == []
    with pytest.raises(EngineOutOfMemoryError) as err:
        engine.step()
    assert str(err.value) == (
        "4 out-of-memory errors in a row, the last at a step of 3 tokens (1 sequences) within "
        "a step budget of 16 of 32 tokens: injected at call 3"
    )
    assert dict(engine.stats().num_oom_events) == {"step": 4, "swap": 0, "startup": 0}
    assert engine.stats().step_token_budget == 16  # the floor


def test_without_chunked_prefill_a_reduced_budget_rejects_nothing_and_stalls_nothing() -> None:
    engine, runner = make_engine(budget=32, chunked=False, max_model_len=64)
    runner.oom_at_steps = {0}
    engine.add_request("short", [1, 2, 3], GREEDY)
    assert engine.step() == []
    assert engine.step_budget.current == 16
    long_prompt = list(range(1, 31))
    engine.check_request(long_prompt, GREEDY)  # 30 tokens still fit the configured 32
    engine.add_request("long", long_prompt, GREEDY)
    outputs = run_all(engine)
    assert tokens_of(outputs["short"]) == rollout([1, 2, 3], 12)
    assert tokens_of(outputs["long"]) == rollout(long_prompt, 12)
    assert 30 in runner.num_batched_tokens  # admitted once nothing could run within 16
