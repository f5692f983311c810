"""The step loop, driven by a fake runner that reads its KV cache back
(`tests.engine.fakes.PagedFakeRunner`). Text and stop strings are the front end's
(`tests/engine/frontend`)."""

from __future__ import annotations

from typing import Any

import pytest

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import EngineOutput
from tests.engine.fakes import EOS, make_engine, rollout, run_all, tokens_of

BASE = list(range(1, 13))
PROMPTS = {
    "p0": [3, 1, 4],
    "p1": [*BASE, 5, 9],
    "p2": list(range(20, 37)),
    "p3": [*BASE[:8], 2, 6, 5, 3, 5, 8, 9, 7, 9],
    "p4": [7] * 5,
    "p5": [*BASE, 2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9],
}
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


def generate_alone(prompt: list[int]) -> list[int]:
    engine, _ = make_engine()
    engine.add_request("alone", prompt, GREEDY)
    return tokens_of(run_all(engine)["alone"])


@pytest.mark.parametrize(
    ("name", "engine_args"),
    [
        ("recompute", {"num_gpu_blocks": 14, "budget": 16}),
        ("recompute-no-prefix-cache", {"num_gpu_blocks": 14, "budget": 16, "prefix": False}),
        ("swap", {"num_gpu_blocks": 14, "num_cpu_blocks": 64, "budget": 16, "min_swap_tokens": 4}),
        ("no-chunked-prefill", {"num_gpu_blocks": 14, "budget": 32, "chunked": False}),
    ],
)
def test_batch_under_preemption_equals_each_prompt_alone(
    name: str, engine_args: dict[str, Any]
) -> None:
    alone = {rid: generate_alone(prompt) for rid, prompt in PROMPTS.items()}
    assert alone == {rid: rollout(prompt, 20) for rid, prompt in PROMPTS.items()}

    engine, runner = make_engine(**engine_args)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = run_all(engine)
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == alone
    for outs in outputs.values():
        assert [o.finished for o in outs] == [False] * 19 + [True]
        assert outs[-1].finish_reason == "length"
        assert outs[-1].num_output_tokens == 20
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if name == "swap":
        assert stats.num_swap_preemptions > 0
    if engine_args.get("prefix", True):
        assert stats.prefix_cache_hits > 0
    assert max(runner.num_batched_tokens) <= engine_args["budget"]
    assert (stats.num_used_blocks, stats.num_swap_blocks_used, stats.num_running) == (0, 0, 0)
    assert stats.num_generation_tokens == 6 * 20
    assert stats.num_prompt_tokens == sum(len(p) for p in PROMPTS.values())
    assert stats.num_requests_success == {"stop": 0, "length": 6, "abort": 0}


def script_engine(script: list[int], **engine_args: Any) -> LLMEngine:
    engine, _ = make_engine(script={"r": script}, **engine_args)
    return engine


def generate(
    engine: LLMEngine, params: SamplingParams, prompt: list[int] | None = None
) -> list[EngineOutput]:
    engine.add_request("r", prompt or [1, 2, 3], params)
    return run_all(engine)["r"]


def test_eos_and_stop_token_ids_end_the_request_with_their_token() -> None:
    outs = generate(script_engine([0, 1, EOS, 2]), SamplingParams(max_tokens=4))
    assert (tokens_of(outs), outs[-1].finish_reason) == ([0, 1, EOS], "stop")

    outs = generate(script_engine([0, 1, EOS, 2]), SamplingParams(max_tokens=4, ignore_eos=True))
    assert (tokens_of(outs), outs[-1].finish_reason) == ([0, 1, EOS, 2], "length")

    outs = generate(script_engine([0, 1, 2, 3]), SamplingParams(max_tokens=4, stop_token_ids=(2,)))
    assert (tokens_of(outs), outs[-1].finish_reason) == ([0, 1, 2], "stop")


def test_min_tokens_defers_stop_tokens() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=4)
    outs = generate(script_engine([0, 1, EOS, 2, EOS, 5, 5, 5, 5, 5]), params)
    assert (tokens_of(outs), outs[-1].finish_reason) == ([0, 1, EOS, 2, EOS], "stop")


def test_an_abort_for_a_stop_string_counts_as_stopped() -> None:
    engine = script_engine(list(range(20)))
    engine.add_request("r", [1, 2, 3], GREEDY)
    engine.step()
    assert engine.abort("r", "stop") is True
    [out] = engine.step()
    assert (out.finished, out.finish_reason) == (True, "stop")
    assert engine.stats().num_requests_success == {"stop": 1, "length": 0, "abort": 0}


def test_max_model_len_ends_generation_with_length() -> None:
    engine, _ = make_engine(max_model_len=10)
    outs = generate(engine, SamplingParams(max_tokens=50), prompt=list(range(8)))
    assert outs[-1].num_output_tokens == 2
    assert outs[-1].finish_reason == "length"


def test_logprobs_only_when_requested() -> None:
    outs = generate(script_engine([4, 7]), SamplingParams(max_tokens=2, logprobs=True))
    assert [o.logprobs for o in outs] == [[-0.04], [-0.07]]
    outs = generate(script_engine([4, 7]), SamplingParams(max_tokens=2))
    assert [o.logprobs for o in outs] == [[], []]


def test_prefix_hit_is_reported_in_cached_tokens() -> None:
    engine, _ = make_engine()
    engine.add_request("first", list(range(1, 11)), GREEDY)
    run_all(engine)
    engine.add_request("second", [*range(1, 9), 40, 41], GREEDY)
    outs = run_all(engine)["second"]
    assert outs[-1].num_cached_tokens == 8
    assert tokens_of(outs) == rollout([*range(1, 9), 40, 41], 20)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_requests_that_can_never_run_are_rejected_at_add() -> None:
    engine, _ = make_engine(max_model_len=16)
    with pytest.raises(RequestRejectedError, match="maximum context length of 16"):
        engine.add_request("r", list(range(16)), GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        engine.add_request("r", [1], SamplingParams(max_tokens=0))
    assert not engine.has_work()


def test_abort_frees_blocks_and_reports_once() -> None:
    engine, _ = make_engine()
    engine.add_request("r", list(range(10)), GREEDY)
    engine.step()
    assert engine.stats().num_used_blocks == 3
    assert engine.abort("r") is True
    assert engine.abort("r") is False
    assert engine.stats().num_used_blocks == 0
    [out] = engine.step()
    assert (out.request_id, out.finished, out.finish_reason, out.new_token_ids) == (
        "r",
        True,
        "abort",
        [],
    )
    assert engine.stats().num_requests_success["abort"] == 1
    assert not engine.has_work()


def test_runner_failure_fails_the_step_and_the_engine_goes_on() -> None:
    engine, runner = make_engine()
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5], GREEDY)
    runner.fail_next = True
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert (
        outs[0].error
        == "the engine failed while running this request: RuntimeError: device fell over"
    )
    stats = engine.stats()
    assert (stats.num_failed_steps, stats.num_used_blocks, stats.num_running) == (1, 0, 0)
    engine.add_request("c", [1, 2, 3], GREEDY)
    assert tokens_of(run_all(engine)["c"]) == rollout([1, 2, 3], 20)
    assert engine.num_consecutive_failed_steps == 0
