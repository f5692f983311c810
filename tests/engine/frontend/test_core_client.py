"""The front end's `CoreClient` against a real `EngineCore` over ZMQ (fake runner, core on a
thread): text and stop strings, streaming, cancellation, rejection, drain, failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.client import (
    EngineDeadError,
    EngineDrainingError,
    RequestFailedError,
    RequestOutput,
)
from pagekeeper_engine.frontend.core_client import CoreClient
from tests.engine.fake_core import collect, fake_core
from tests.engine.fakes import EOS, CharTokenizer, make_engine, rollout

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
PROMPTS = {"p0": [3, 1, 4], "p1": [*range(1, 13), 5, 9], "p2": list(range(20, 37))}
DRAIN_BOUND_S = 60.0  # a bound on the drain's condition (a few fake steps), not a speed


def ids(text: str) -> list[int]:
    return CharTokenizer().encode(text)


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def scripted(script: list[int], params: SamplingParams) -> list[RequestOutput]:
    async def main() -> list[RequestOutput]:
        async with fake_core(script={"r": script}) as fake:
            return await collect(fake.client, "r", [1, 2, 3], params)

    return asyncio.run(main())


async def wait_until_idle(client: CoreClient) -> None:
    for _ in range(3000):  # a bound, not a timing: each turn waits on the core's next report
        stats = client.stats()
        assert stats is not None
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {client.stats()}")


def test_stop_string_is_trimmed_and_the_core_stops_the_request() -> None:
    async def main() -> tuple[list[RequestOutput], dict[str, int]]:
        # the script runs to max_tokens; the step after "1" waits for the front end's stop
        async with fake_core(script={"r": ids("abcd1efghijklmnopqrs")}) as fake:
            fake.hold_step_until_a_message(call=5)
            outs = await collect(fake.client, "r", [1, 2, 3], SamplingParams(20, stop=("cd1",)))
            await wait_until_idle(fake.client)
            stats = fake.client.stats()
            assert stats is not None
            return outs, dict(stats.num_requests_success)

    outs, successes = asyncio.run(main())
    assert text_of(outs) == "ab"
    assert tokens_of(outs) == ids("abcd1")
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "stop")
    # the core finished the request as stopped, not aborted, and freed its blocks
    assert successes == {"stop": 1, "length": 0, "abort": 0}


def test_earliest_of_several_stop_strings_wins() -> None:
    outs = scripted(ids("xyzabcab"), SamplingParams(max_tokens=8, stop=("bca", "zab")))
    assert text_of(outs) == "xy"
    assert outs[-1].num_output_tokens == 5


def test_held_back_text_is_released_when_no_stop_string_completes() -> None:
    outs = scripted(ids("abcab"), SamplingParams(max_tokens=5, stop=("abd",)))
    assert (text_of(outs), outs[-1].finish_reason) == ("abcab", "length")


def test_eos_and_stop_token_ids_end_without_their_text() -> None:
    outs = scripted([0, 1, EOS, 2], SamplingParams(max_tokens=4))
    assert (text_of(outs), tokens_of(outs), outs[-1].finish_reason) == ("ab", [0, 1, EOS], "stop")
    outs = scripted([0, 1, EOS, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert (text_of(outs), outs[-1].finish_reason) == ("abNc", "length")
    outs = scripted([0, 1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(2,)))
    assert (text_of(outs), tokens_of(outs), outs[-1].finish_reason) == ("ab", [0, 1, 2], "stop")


def test_min_tokens_defers_every_stop_condition() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=4, stop=("ab",))
    outs = scripted([0, 1, EOS, 2, EOS, 5, 5, 5, 5, 5], params)
    assert (text_of(outs), outs[-1].num_output_tokens, outs[-1].finish_reason) == (
        "abNc",
        5,
        "stop",
    )


def test_logprobs_cross_the_boundary_only_when_requested() -> None:
    outs = scripted([4, 7], SamplingParams(max_tokens=2, logprobs=True))
    assert [p for o in outs for p in o.logprobs] == [-0.04, -0.07]
    outs = scripted([4, 7], SamplingParams(max_tokens=2))
    assert [p for o in outs for p in o.logprobs] == []


def test_concurrent_streams_get_their_own_tokens() -> None:
    async def main() -> dict[str, list[RequestOutput]]:
        async with fake_core(num_gpu_blocks=14, budget=16) as fake:
            results = await asyncio.gather(
                *(collect(fake.client, rid, p, GREEDY) for rid, p in PROMPTS.items())
            )
            assert fake.client.is_alive()
            return dict(zip(PROMPTS, results, strict=True))

    results = asyncio.run(main())
    assert {rid: tokens_of(outs) for rid, outs in results.items()} == {
        rid: rollout(p, 20) for rid, p in PROMPTS.items()
    }
    assert all(outs[-1].finished and outs[-1].num_output_tokens == 20 for outs in results.values())


def test_a_cancelled_consumer_aborts_and_frees_blocks() -> None:
    async def main() -> int:
        async with fake_core() as fake:
            fake.hold_step_until_a_message(call=2)  # its third step waits for the abort
            params = SamplingParams(max_tokens=100, temperature=0.0)
            task = asyncio.create_task(collect(fake.client, "r", list(range(10)), params))
            requests = fake.engine.request_outputs
            while fake.client.num_in_flight == 0 or requests.num_generation_tokens < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until_idle(fake.client)
            stats = fake.client.stats()
            assert stats is not None
            return stats.num_requests_success["abort"]

    assert asyncio.run(main()) == 1


def test_a_request_that_can_never_run_is_rejected_at_first_iteration() -> None:
    async def main() -> None:
        async with fake_core(max_model_len=16) as fake:
            with pytest.raises(RequestRejectedError, match="maximum context length"):
                await collect(fake.client, "r", list(range(16)), GREEDY)
            assert fake.client.num_in_flight == 0
            outs = await collect(fake.client, "ok", [1, 2, 3], SamplingParams(max_tokens=2))
            assert outs[-1].finished

    asyncio.run(main())


def test_drain_finishes_running_requests_then_refuses_new_ones() -> None:
    async def main() -> tuple[list[RequestOutput], bool]:
        async with fake_core() as fake:
            # its third step waits until the drain has begun: it is running then
            fake.hold_step_until(2, lambda: fake.client.is_draining, "the drain")
            task = asyncio.create_task(collect(fake.client, "r", [1, 2, 3], GREEDY))
            while fake.client.num_in_flight == 0:
                await asyncio.sleep(0.005)
            is_clean = await fake.client.drain(timeout=DRAIN_BOUND_S)
            with pytest.raises(EngineDrainingError):
                await collect(fake.client, "late", [1], GREEDY)
            return await task, is_clean

    outs, is_clean = asyncio.run(main())
    assert is_clean
    assert tokens_of(outs) == rollout([1, 2, 3], 20)


def test_drain_timeout_aborts_what_is_left() -> None:
    async def main() -> tuple[list[RequestOutput], bool]:
        async with fake_core() as fake:
            # from its third step on, each step waits for a message: the drain's notice
            # releases one, the abort it sends at its deadline the next, so the request cannot
            # finish before the deadline
            fake.hold_steps_until_messages(first_call=2)
            params = SamplingParams(max_tokens=100, temperature=0.0)
            task = asyncio.create_task(collect(fake.client, "r", [1, 2, 3], params))
            while fake.client.num_in_flight == 0:
                await asyncio.sleep(0.005)
            is_clean = await fake.client.drain(timeout=0.1)
            return await task, is_clean

    outs, is_clean = asyncio.run(main())
    assert not is_clean
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "abort")
    assert len(tokens_of(outs)) <= 4  # the two free steps' and one per message


def test_a_failed_step_fails_its_request_and_the_core_goes_on() -> None:
    engine, runner = make_engine()
    runner.fail_next = True

    async def main() -> list[RequestOutput]:
        async with fake_core(engine) as fake:
            with pytest.raises(RequestFailedError, match="device fell over"):
                await collect(fake.client, "r", [1, 2, 3], GREEDY)
            assert fake.client.is_alive()
            return await collect(fake.client, "r2", [1, 2, 3], GREEDY)

    assert tokens_of(asyncio.run(main())) == rollout([1, 2, 3], 20)


def test_steps_that_keep_failing_outside_the_runner_stop_the_core_looking_alive() -> None:
    """A step that raises before the runner (a scheduler bug) fails what is in flight and counts
    toward the consecutive-failure limit, so a loop that fails every step turns health red
    instead of looking alive."""
    engine, _ = make_engine()

    def broken_step() -> list[object]:
        raise RuntimeError("scheduler invariant broken")

    engine.step = broken_step  # type: ignore[method-assign]

    async def main() -> tuple[bool, bool]:
        async with fake_core(engine) as fake:
            alive_before = fake.client.is_alive()
            with pytest.raises(RequestFailedError, match="failed while stepping"):
                await collect(fake.client, "r", [1, 2, 3], GREEDY)
            limit = fake.client.max_consecutive_failed_steps
            while (stats := fake.client.stats()) is None or (
                stats.num_consecutive_failed_steps < limit
            ):
                await asyncio.sleep(0.01)
            return alive_before, fake.client.is_alive()

    assert asyncio.run(main()) == (True, False)
    assert engine.num_failed_steps >= 3
    assert engine.num_consecutive_failed_steps == engine.num_failed_steps


def test_shutdown_fails_requests_in_flight_and_ends_the_core() -> None:
    async def main() -> list[int]:
        async with fake_core() as fake:
            fake.hold_step_until_a_message(call=1)  # its second step waits for the shutdown
            params = SamplingParams(max_tokens=100, temperature=0.0)
            task = asyncio.create_task(collect(fake.client, "r", [1, 2, 3], params))
            while fake.engine.request_outputs.num_generation_tokens < 1:
                await asyncio.sleep(0.01)
            fake.client.shutdown_core()
            with pytest.raises(RequestFailedError, match="shutting down"):
                await task
            await asyncio.to_thread(fake.thread.join, 30.0)
            return fake.exit_codes

    assert asyncio.run(main()) == [0]


def test_the_core_giving_up_fails_requests_and_the_client_reports_it() -> None:
    engine, runner = make_engine(max_consecutive_ooms=2)
    runner.oom_at_steps = set(range(100))

    async def main() -> tuple[list[int], str | None, bool]:
        async with fake_core(engine) as fake:
            with pytest.raises(EngineDeadError, match="gave up: 3 out-of-memory errors"):
                await collect(fake.client, "r", [1, 2, 3], GREEDY)
            await asyncio.to_thread(fake.thread.join, 30.0)
            with pytest.raises(EngineDrainingError):
                await collect(fake.client, "late", [1], GREEDY)
            return fake.exit_codes, fake.core.fatal_error, fake.client.is_alive()

    exit_codes, fatal_error, is_alive = asyncio.run(main())
    assert exit_codes == [1]
    assert fatal_error is not None and "3 out-of-memory errors in a row" in fatal_error
    assert not is_alive
    assert dict(engine.stats().num_oom_events) == {"step": 3, "swap": 0, "startup": 0}
