"""Scheduler: token budget, chunked prefill, ordering, admission, preemption and swap."""

from __future__ import annotations

import pytest

from pagekeeper_engine.core.limits import RequestRejectedError, SchedulerConfig
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.preemption import PreemptionMode, choose_preemption_mode
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus

BS = 4


def make(
    num_blocks: int = 33,
    budget: int = 64,
    max_num_seqs: int = 8,
    chunked: bool = True,
    prefix: bool = True,
    watermark: float = 0.0,
    num_cpu_blocks: int = 0,
    min_swap_tokens: int = 512,
    max_model_len: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        prefix_cache_max_fraction=1.0,
        kv_watermark=watermark,
        min_swap_tokens=min_swap_tokens,
    )
    return Scheduler(config, num_blocks, num_cpu_blocks)


def add(sched: Scheduler, request_id: str, num_tokens: int, first: int = 0) -> Sequence:
    seq = Sequence(request_id, list(range(first, first + num_tokens)), SamplingParams())
    sched.add_request(seq)
    return seq


def run(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Pretend the model ran: sample token 500 + position for every sequence that samples."""
    tokens = [500 + s.start_pos + s.num_tokens if s.needs_sample else None for s in out.seqs]
    logprobs = [-0.25 if s.needs_sample else None for s in out.seqs]
    return sched.update(out, RunnerOutput(tokens, logprobs))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, s.num_tokens, s.needs_sample) for s in out.seqs]


def test_token_budget_chunks_prefill_and_puts_decodes_first() -> None:
    sched = make(budget=10)
    a = add(sched, "a", 6)
    b = add(sched, "b", 7, first=100)
    out = sched.schedule()
    assert plan(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert out.num_batched_tokens == 10
    assert out.seqs[1].token_ids == [100, 101, 102, 103]
    # the whole prompt's blocks are reserved at admission
    assert (a.block_ids, b.block_ids) == ([1, 2], [3, 4])
    assert run(sched, out) == [a]
    assert a.token_ids[-1] == 506
    assert a.output_logprobs == [-0.25]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 4)

    out = sched.schedule()
    assert plan(out) == [("a", 6, 1, True), ("b", 4, 3, True)]
    assert out.seqs[0].token_ids == [506]
    assert out.num_batched_tokens == 4
    assert run(sched, out) == [a, b]
    assert b.output_token_ids == [507]


def test_one_token_chunks_lead_the_batch() -> None:
    sched = make()
    e = add(sched, "e", 17)
    run(sched, sched.schedule())
    sched.finish(e, SequenceStatus.FINISHED_STOPPED)
    add(sched, "c", 6, first=100)
    add(sched, "d", 17)  # 16 tokens cached: one token left to compute
    out = sched.schedule()
    assert plan(out) == [("d", 16, 1, True), ("c", 0, 6, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits() -> None:
    sched = make(budget=10, chunked=False)
    add(sched, "a", 6)
    add(sched, "b", 7, first=100)
    out = sched.schedule()
    assert plan(out) == [("a", 0, 6, True)]
    run(sched, out)
    assert plan(sched.schedule()) == [("a", 6, 1, True), ("b", 0, 7, True)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make(max_num_seqs=2)
    for index, name in enumerate("abc"):
        add(sched, name, 3, first=100 * index)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_admission_leaves_the_watermark_free() -> None:
    sched = make(num_blocks=11, watermark=0.2)  # 10 usable blocks, 2 kept free
    assert sched.watermark_blocks == 2
    add(sched, "a", 16)  # 4 blocks
    add(sched, "b", 20, first=100)  # 5 blocks: 6 free - 2 watermark = 4 < 5
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"]
    assert sched.kv.num_free_blocks == 6
    assert [s.request_id for s in sched.waiting] == ["b"]

    no_watermark = make(num_blocks=11, watermark=0.0)
    add(no_watermark, "a", 16)
    add(no_watermark, "b", 20, first=100)
    assert [s.request_id for s in no_watermark.schedule().seqs] == ["a", "b"]


def test_requests_that_can_never_run_are_rejected() -> None:
    sched = make(num_blocks=11, watermark=0.2, max_model_len=40)
    with pytest.raises(RequestRejectedError, match="the prompt is empty"):
        sched.check_request(0)
    with pytest.raises(
        RequestRejectedError, match="40 tokens; with one generated token that exceeds"
    ):
        sched.check_request(40)
    # 32 + 1 tokens need 9 blocks; 10 usable - 2 watermark = 8
    with pytest.raises(RequestRejectedError, match=r"needs 9 KV blocks of 4; .* at most 8 blocks"):
        sched.check_request(32)
    sched.check_request(31)
    assert issubclass(RequestRejectedError, ValueError)

    no_chunks = make(budget=10, chunked=False)
    with pytest.raises(RequestRejectedError, match="must fit in one step of max_num_batched"):
        no_chunks.check_request(11)
    no_chunks.check_request(10)

    add(sched, "a", 3)
    with pytest.raises(RequestRejectedError, match="'a' is already in flight"):
        add(sched, "a", 3)


def decode_until_full(
    num_cpu_blocks: int, min_swap_tokens: int = 512
) -> tuple[Scheduler, Sequence, Sequence, Sequence, Sequence]:
    """Three 7-token prompts in 7 usable blocks: two steps fill every block but one."""
    sched = make(num_blocks=8, num_cpu_blocks=num_cpu_blocks, min_swap_tokens=min_swap_tokens)
    a = add(sched, "a", 7)
    b = add(sched, "b", 7, first=100)
    c = add(sched, "c", 7, first=200)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    assert (a.block_ids, b.block_ids, c.block_ids) == ([1, 2], [3, 4], [5, 6])
    assert [s.num_computed_tokens for s in (a, b, c)] == [8, 8, 8]
    d = add(sched, "d", 5, first=300)
    return sched, a, b, c, d


def test_preemption_by_recompute_takes_the_newest_and_resumes_it_first() -> None:
    sched, a, b, c, _ = decode_until_full(num_cpu_blocks=0)
    out = sched.schedule()
    # a takes the last free block; b needs one more, so c (newest, not yet scheduled) goes
    assert plan(out) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert out.preempted_ids == ["c"]
    assert out.blocks_to_swap_out == []
    assert (a.block_ids, b.block_ids) == ([1, 2, 7], [3, 4, 6])
    assert c.status is SequenceStatus.WAITING
    assert (c.block_ids, c.num_computed_tokens, c.num_preemptions) == ([], 0, 1)
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert sched.num_recompute_preemptions == 1
    run(sched, out)

    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    sched.finish(b, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    # c's blocks were freed last-first, so b's new block evicted c's second block (6) and
    # c finds only its first block (5) in the prefix cache
    assert plan(out) == [("c", 4, 5, True), ("d", 0, 5, True)]
    assert out.seqs[0].token_ids == [204, 205, 206, 507, 508]
    assert c.block_ids == [5, 7, 6]
    assert c.num_cached_tokens == 0  # usage reports the first admission's hit


def test_recompute_without_prefix_cache_reruns_prompt_and_outputs() -> None:
    sched = make(num_blocks=4, prefix=False)
    a = add(sched, "a", 3)
    b = add(sched, "b", 3, first=100)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    out = sched.schedule()  # both need a second block; only one is free
    assert out.preempted_ids == ["b"]
    run(sched, out)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert plan(out) == [("b", 0, 5, True)]
    assert out.seqs[0].token_ids == [100, 101, 102, 503, 504]
    assert b.output_token_ids == [503, 504]


def test_preemption_rule_swaps_long_sequences_when_the_cpu_has_room() -> None:
    assert choose_preemption_mode(511, 100, 32, 512) is PreemptionMode.RECOMPUTE
    assert choose_preemption_mode(512, 100, 32, 512) is PreemptionMode.SWAP
    assert choose_preemption_mode(512, 31, 32, 512) is PreemptionMode.RECOMPUTE
    assert choose_preemption_mode(0, 100, 0, 0) is PreemptionMode.RECOMPUTE
    assert choose_preemption_mode(1, 100, 1, 0) is PreemptionMode.SWAP


def test_swap_out_and_back_in_with_exact_block_ids() -> None:
    sched, a, b, c, _ = decode_until_full(num_cpu_blocks=4, min_swap_tokens=8)
    out = sched.schedule()
    assert out.preempted_ids == ["c"]
    assert out.blocks_to_swap_out == [(5, 0), (6, 1)]
    assert c.status is SequenceStatus.SWAPPED
    assert (c.block_ids, c.num_computed_tokens) == ([0, 1], 8)
    assert b.block_ids == [3, 4, 6]
    assert sched.num_swap_preemptions == 1
    assert sched.cpu_pool is not None and sched.cpu_pool.num_used_blocks == 2
    run(sched, out)

    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    # c comes back before d is admitted, and decodes in the same step
    # free block 7 first, then the oldest cache-only blocks 5 and 2
    assert out.blocks_to_swap_in == [(0, 7), (1, 5)]
    assert out.swapped_in_ids == ["c"]
    assert c.block_ids == [7, 5, 2]
    assert plan(out) == [("b", 9, 1, True), ("c", 8, 1, True)]
    assert out.seqs[1].token_ids == [508]
    assert sched.cpu_pool.num_used_blocks == 0
    assert [s.request_id for s in sched.waiting] == ["d"]


def test_nothing_is_admitted_while_a_sequence_is_swapped_out() -> None:
    sched, _, _, _, d = decode_until_full(num_cpu_blocks=4, min_swap_tokens=8)
    run(sched, sched.schedule())
    out = sched.schedule()  # c needs 3 blocks to come back; 1 is free
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert out.blocks_to_swap_in == []
    assert d.status is SequenceStatus.WAITING


def test_cpu_pool_full_falls_back_to_recompute() -> None:
    sched, _, _, c, _ = decode_until_full(num_cpu_blocks=1, min_swap_tokens=8)
    out = sched.schedule()
    assert out.preempted_ids == ["c"]
    assert out.blocks_to_swap_out == []
    assert c.status is SequenceStatus.WAITING


def test_finish_frees_blocks_wherever_the_sequence_is() -> None:
    sched, a, b, c, d = decode_until_full(num_cpu_blocks=4, min_swap_tokens=8)
    run(sched, sched.schedule())
    assert sched.cpu_pool is not None and sched.cpu_pool.num_used_blocks == 2
    sched.finish(c, SequenceStatus.FINISHED_ABORTED)
    assert sched.cpu_pool.num_used_blocks == 0
    sched.finish(d, SequenceStatus.FINISHED_ABORTED)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 7
    assert sched.requests == {}
    assert not sched.has_work()


def test_a_sequence_grown_into_the_watermark_returns_once_it_runs_alone() -> None:
    sched = make(num_blocks=11, watermark=0.2)  # 10 usable blocks, 2 kept free at admission
    b = add(sched, "b", 3)
    a = add(sched, "a", 28, first=100)  # 7 blocks: exactly 9 free - 2 watermark
    preempted: list[str] = []
    for _ in range(10):
        out = sched.schedule()
        preempted += out.preempted_ids
        run(sched, out)
        if preempted:
            break
    # decodes may use the watermark; a grew into it and was preempted for b's next block
    assert preempted == ["a"]
    assert a.num_tokens == 33
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["b"]
    assert a.status is SequenceStatus.WAITING
    run(sched, out)
    sched.finish(b, SequenceStatus.FINISHED_LENGTH)
    # 9 blocks > 10 - 2, but with nothing running the watermark protects no one
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"]
    assert len(a.block_ids) == 9
