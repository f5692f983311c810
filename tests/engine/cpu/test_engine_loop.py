"""The step loop and its asyncio front, driven by a fake runner that reads its KV cache back
(`tests.engine.fakes.PagedFakeRunner`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagekeeper_engine.async_engine import (
    AsyncLLMEngine,
    EngineDrainingError,
    RequestFailedError,
)
from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.outputs import RequestOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.engine import LLMEngine
from tests.engine.fakes import (
    EOS,
    CharTokenizer,
    make_engine,
    rollout,
    run_all,
    text_of,
    tokens_of,
)

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
    for rid, outs in outputs.items():
        assert text_of(outs) == CharTokenizer().decode(alone[rid])
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
) -> list[RequestOutput]:
    engine.add_request("r", prompt or [1, 2, 3], params)
    return run_all(engine)["r"]


def ids(text: str) -> list[int]:
    return CharTokenizer().encode(text)


def test_stop_string_is_trimmed_and_never_streamed() -> None:
    engine = script_engine(ids("abcd1efgh"))
    outs = generate(engine, SamplingParams(max_tokens=9, stop=("cd1",)))
    assert [o.new_text for o in outs] == ["", "", "a", "b", ""]
    assert text_of(outs) == "ab"
    assert tokens_of(outs) == ids("abcd1")
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "stop")


def test_earliest_of_several_stop_strings_wins() -> None:
    engine = script_engine(ids("xyzabcab"))
    outs = generate(engine, SamplingParams(max_tokens=8, stop=("bca", "zab")))
    assert text_of(outs) == "xy"
    assert outs[-1].num_output_tokens == 5


def test_held_back_text_is_released_when_no_stop_string_completes() -> None:
    engine = script_engine(ids("abcab"))
    outs = generate(engine, SamplingParams(max_tokens=5, stop=("abd",)))
    assert [o.new_text for o in outs] == ["", "", "a", "b", "cab"]
    assert outs[-1].finish_reason == "length"


def test_eos_and_stop_token_ids_end_without_their_text() -> None:
    outs = generate(script_engine([0, 1, EOS, 2]), SamplingParams(max_tokens=4))
    assert (text_of(outs), tokens_of(outs), outs[-1].finish_reason) == ("ab", [0, 1, EOS], "stop")

    outs = generate(script_engine([0, 1, EOS, 2]), SamplingParams(max_tokens=4, ignore_eos=True))
    assert (text_of(outs), outs[-1].finish_reason) == ("abNc", "length")

    outs = generate(script_engine([0, 1, 2, 3]), SamplingParams(max_tokens=4, stop_token_ids=(2,)))
    assert (text_of(outs), tokens_of(outs), outs[-1].finish_reason) == ("ab", [0, 1, 2], "stop")


def test_min_tokens_defers_every_stop_condition() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=4, stop=("ab",))
    outs = generate(script_engine([0, 1, EOS, 2, EOS, 5, 5, 5, 5, 5]), params)
    assert (text_of(outs), outs[-1].num_output_tokens, outs[-1].finish_reason) == (
        "abNc",
        5,
        "stop",
    )


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


# --- the asyncio front ---------------------------------------------------------------------


def start(engine: LLMEngine) -> AsyncLLMEngine:
    front = AsyncLLMEngine(engine)
    front.start()
    return front


async def collect(
    front: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in front.generate(rid, prompt, params)]


async def wait_until_idle(front: AsyncLLMEngine) -> None:
    for _ in range(200):
        stats = front.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still busy: {front.stats()}")


def test_async_streams_concurrent_requests() -> None:
    engine, _ = make_engine(num_gpu_blocks=14, budget=16)
    front = start(engine)

    async def main() -> dict[str, list[RequestOutput]]:
        results = await asyncio.gather(
            *(collect(front, rid, p, GREEDY) for rid, p in PROMPTS.items())
        )
        return dict(zip(PROMPTS, results, strict=True))

    try:
        results = asyncio.run(main())
        assert front.is_alive()
    finally:
        front.shutdown()
    assert {rid: tokens_of(outs) for rid, outs in results.items()} == {
        rid: rollout(p, 20) for rid, p in PROMPTS.items()
    }
    assert all(outs[-1].finished for outs in results.values())
    assert not front.is_alive()


def test_async_cancelled_consumer_aborts_and_frees_blocks() -> None:
    engine, _ = make_engine(step_delay_s=0.01)
    front = start(engine)

    async def main() -> None:
        params = SamplingParams(max_tokens=100, temperature=0.0)
        task = asyncio.create_task(collect(front, "r", list(range(10)), params))
        while front.stats().num_generation_tokens < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(front)

    try:
        asyncio.run(main())
        assert front.stats().num_requests_success["abort"] == 1
    finally:
        front.shutdown()


def test_async_rejects_bad_requests_at_first_iteration() -> None:
    engine, _ = make_engine(max_model_len=16)
    front = start(engine)
    try:
        with pytest.raises(RequestRejectedError, match="maximum context length"):
            asyncio.run(collect(front, "r", list(range(16)), GREEDY))
    finally:
        front.shutdown()


def test_async_drain_finishes_running_requests_then_refuses_new_ones() -> None:
    engine, _ = make_engine(step_delay_s=0.005)
    front = start(engine)

    async def main() -> tuple[list[RequestOutput], bool]:
        task = asyncio.create_task(collect(front, "r", [1, 2, 3], GREEDY))
        while front.num_in_flight == 0:
            await asyncio.sleep(0.005)
        is_clean = await front.drain(timeout=10.0)
        with pytest.raises(EngineDrainingError):
            await collect(front, "late", [1], GREEDY)
        return await task, is_clean

    try:
        outs, is_clean = asyncio.run(main())
    finally:
        front.shutdown()
    assert is_clean
    assert tokens_of(outs) == rollout([1, 2, 3], 20)


def test_async_drain_timeout_aborts_what_is_left() -> None:
    engine, _ = make_engine(step_delay_s=0.02)
    front = start(engine)

    async def main() -> tuple[list[RequestOutput], bool]:
        params = SamplingParams(max_tokens=100, temperature=0.0)
        task = asyncio.create_task(collect(front, "r", [1, 2, 3], params))
        while front.num_in_flight == 0:
            await asyncio.sleep(0.005)
        is_clean = await front.drain(timeout=0.1)
        return await task, is_clean

    try:
        outs, is_clean = asyncio.run(main())
    finally:
        front.shutdown()
    assert not is_clean
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "abort")
    assert len(tokens_of(outs)) < 100


def test_async_step_failure_raises_in_the_consumer() -> None:
    engine, runner = make_engine()
    runner.fail_next = True
    front = start(engine)
    try:
        with pytest.raises(RequestFailedError, match="device fell over"):
            asyncio.run(collect(front, "r", [1, 2, 3], GREEDY))
        assert front.is_alive()
        outs = asyncio.run(collect(front, "r2", [1, 2, 3], GREEDY))
        assert tokens_of(outs) == rollout([1, 2, 3], 20)
    finally:
        front.shutdown()


def test_async_shutdown_fails_requests_in_flight_and_stops_the_thread() -> None:
    engine, _ = make_engine(step_delay_s=0.02)
    front = start(engine)

    async def main() -> None:
        params = SamplingParams(max_tokens=100, temperature=0.0)
        task = asyncio.create_task(collect(front, "r", [1, 2, 3], params))
        while front.stats().num_generation_tokens < 1:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(front.shutdown)
        with pytest.raises(RuntimeError, match="the engine loop stopped"):
            await task
        with pytest.raises(EngineDrainingError):
            await collect(front, "late", [1], GREEDY)

    asyncio.run(main())
    assert not front.is_alive()
