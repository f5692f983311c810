"""The host KV tier's bookkeeping (pure): its LRU of host blocks, the copies a step carries and
the fence they need, and the prefix cache over both tiers with exact block ids; then the engine
loop over a fake device that runs each copy as late as the fences allow."""

from __future__ import annotations

import pytest

from pagekeeper_engine.core.host_tier import EvictedRecord, HostTier
from pagekeeper_engine.core.kv_copies import CopyFence, CopyPlan, StepCopies
from pagekeeper_engine.core.kv_manager import KVCacheManager
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import Sequence
from tests.engine.fakes import make_engine, rollout, run_all, tokens_of

H = [bytes([i]) * 16 for i in range(10)]


def test_host_blocks_are_taken_in_order_then_the_least_recently_used_goes() -> None:
    tier = HostTier(3)
    assert [tier.store(h) for h in H[:3]] == [(0, None), (1, None), (2, None)]
    assert tier.store(H[0]) is None  # stored already: touched, now the newest
    assert tier.lru_hashes() == [H[1], H[2], H[0]]
    tier.touch(H[1])
    assert tier.store(H[3]) == (2, H[2])  # H[2] was the least recently used
    assert tier.lookup(H[2]) is None and tier.lookup(H[3]) == 2
    tier.note_loaded(H[0])
    assert tier.lru_hashes() == [H[1], H[3], H[0]]
    assert (tier.num_stored, tier.num_loaded, tier.num_evicted) == (4, 1, 1)
    assert tier.num_used_blocks == 3


def test_the_evicted_record_is_bounded_and_forgets_what_is_cached_again() -> None:
    record = EvictedRecord(2)
    for h in H[:3]:
        record.add(h)
    assert H[0] not in record and H[1] in record and H[2] in record
    record.discard(H[1])
    assert H[1] not in record
    nothing = EvictedRecord(0)
    nothing.add(H[0])
    assert H[0] not in nothing


def test_a_step_fences_only_what_it_reuses_or_reads() -> None:
    plan = CopyPlan()
    plan.store(5, 0)
    plan.allocated([7])  # not copied: no fence
    assert plan.take() == plan_of(stores=[(5, 0)])
    plan.allocated([5])  # stored in an earlier step, now reused
    assert plan.take().fence is CopyFence.PREVIOUS
    plan.allocated([5])  # the fence above covered it
    assert plan.take().fence is CopyFence.NONE
    plan.store(6, 1)
    plan.allocated([6])  # stored in this very step, reused at once
    assert plan.take().fence is CopyFence.ALL


def test_a_request_runs_in_the_step_of_its_loads_behind_a_loads_fence() -> None:
    plan = CopyPlan()
    plan.load(3, 9)
    plan.reads("a", [9, 4])
    plan.reads("b", [4])  # reads nothing loaded
    assert not plan.is_loading_now("a") and not plan.is_loading_now("b")
    plan.runs("b")
    plan.runs("a")
    assert plan.take() == StepCopies([(3, 9)], [], CopyFence.LOADS)
    plan.reads("c", [9])  # the LOADS fence covered block 9
    plan.runs("c")
    plan.allocated([9])
    assert plan.take().fence is CopyFence.NONE


def test_a_load_that_may_race_the_step_in_flight_goes_late_and_its_request_waits() -> None:
    plan = CopyPlan()
    plan.store(4, 0)  # this step stores GPU block 4's old contents into host block 0
    plan.freed([7])  # the step in flight may still read or write block 7
    plan.load(2, 4)  # into a block this step stores: late
    plan.load(0, 8)  # from a host block this step writes: late
    plan.load(1, 7)  # into a freed block: late
    plan.load(3, 6)  # early
    plan.reads("a", [6])
    plan.reads("b", [6, 7])
    assert not plan.is_loading_now("a") and plan.is_loading_now("b")
    plan.runs("a")
    with pytest.raises(AssertionError, match="b runs before its loads"):
        plan.runs("b")
    assert plan.take() == StepCopies(
        [(3, 6)], [(4, 0)], CopyFence.LOADS, late_loads=[(2, 4), (0, 8), (1, 7)]
    )
    plan.load(5, 7)  # a step later block 7 is no longer in flight
    plan.runs("b")  # behind the earlier step's late loads
    assert plan.take() == StepCopies([(5, 7)], [], CopyFence.PREVIOUS)
    plan.allocated([8])  # loaded late two steps ago, fenced since
    plan.allocated([7])  # loaded early a step ago, not fenced since
    assert plan.take().fence is CopyFence.PREVIOUS


def test_reusing_a_block_loaded_early_in_the_same_step_waits_for_that_load() -> None:
    plan = CopyPlan()
    plan.load(1, 3)
    plan.allocated([3])
    assert plan.take().fence is CopyFence.LOADS
    plan.load(2, 5)
    plan.freed([6])
    plan.load(4, 6)
    plan.allocated([6])  # loaded late this step
    assert plan.take().fence is CopyFence.ALL


def plan_of(
    loads: list[tuple[int, int]] | None = None, stores: list[tuple[int, int]] | None = None
) -> StepCopies:
    return StepCopies(loads or [], stores or [], CopyFence.NONE)


def make_seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4))


def prefill(kv: KVCacheManager, seq: Sequence) -> None:
    kv.admit(seq, kv.find_cached_prefix(seq))
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)


def test_blocks_are_written_through_and_an_evicted_prefix_loads_from_the_host() -> None:
    # 4 usable blocks of 8 tokens; the prefix cache may hold all of them
    kv = KVCacheManager(
        5, 8, enable_prefix_caching=True, prefix_cache_max_fraction=1.0, num_host_blocks=3
    )
    a = make_seq("a", list(range(17)))  # 2 full blocks and 1 token
    prefill(kv, a)
    assert a.block_ids == [1, 2, 3]
    assert kv.copies.take().stores == [(1, 0), (2, 1)]  # written through as registered
    kv.free(a)  # last block first: 3 is free, 2 and 1 are cached
    b = make_seq("b", list(range(100, 132)))  # 4 full blocks: takes 4, 3, then evicts 2, 1
    prefill(kv, b)
    assert b.block_ids == [4, 3, 2, 1]
    copies = kv.copies.take()
    assert copies.fence is CopyFence.PREVIOUS  # blocks 1 and 2 were stored a step ago
    # host block 2 was free; then the LRU gives a's two copies, then b's own first one
    assert copies.stores == [(4, 2), (3, 0), (2, 1), (1, 2)]
    assert kv.host is not None and kv.host.lru_hashes() == b.block_hashes[1:]
    kv.free(b)
    again = make_seq("c", list(range(17)))
    hit = kv.find_cached_prefix(again)
    assert (hit.gpu_ids, hit.host_ids) == ([], [])  # a's blocks are on no tier now
    kv.admit(again, hit)
    assert kv.num_evicted_misses == 16  # both were cached once: a larger cache had kept them


def test_a_prefix_only_the_host_holds_loads_into_new_blocks() -> None:
    kv = KVCacheManager(
        6, 8, enable_prefix_caching=True, prefix_cache_max_fraction=0.0, num_host_blocks=8
    )
    a = make_seq("a", list(range(17)))
    prefill(kv, a)
    kv.copies.take()
    kv.free(a)  # the cache may hold nothing on the GPU: both blocks go at once
    assert kv.pool.num_cached_blocks == 0
    b = make_seq("b", [*range(16), 50, 51])
    hit = kv.find_cached_prefix(b)
    assert (hit.gpu_ids, hit.host_ids) == ([-1, -1], [0, 1])
    assert kv.num_blocks_to_admit(b, hit) == 3
    kv.admit(b, hit)
    assert b.block_ids == [4, 5, 3] and b.num_computed_tokens == 16
    assert not kv.copies.is_loading_now("b")  # blocks 4 and 5 were never used: it runs now
    kv.copies.runs("b")
    copies = kv.copies.take()
    assert copies == StepCopies([(0, 4), (1, 5)], [], CopyFence.LOADS)
    assert (kv.num_prefix_hits, kv.num_prefix_host_hits) == (16, 16)
    assert kv.pool.lookup(b.block_hashes[0]) == 4  # the GPU cache has it again


def test_a_prefix_loading_into_blocks_freed_since_the_last_step_waits_a_step() -> None:
    kv = KVCacheManager(
        4, 8, enable_prefix_caching=True, prefix_cache_max_fraction=0.0, num_host_blocks=8
    )
    a = make_seq("a", list(range(17)))
    prefill(kv, a)
    assert a.block_ids == [1, 2, 3]
    kv.copies.take()
    kv.free(a)  # the step in flight may still read a's blocks
    b = make_seq("b", [*range(16), 50, 51])
    kv.admit(b, kv.find_cached_prefix(b))
    assert b.block_ids == [3, 2, 1]
    assert kv.copies.is_loading_now("b")
    copies = kv.copies.take()
    # blocks 1 and 2 were written through a step ago: reusing them waits for those stores
    assert copies == StepCopies([], [], CopyFence.PREVIOUS, late_loads=[(0, 3), (1, 2)])
    kv.copies.runs("b")
    assert kv.copies.take().fence is CopyFence.PREVIOUS


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_turn_prefixes_come_back_from_the_host_with_the_same_tokens(
    async_scheduling: bool,
) -> None:
    """Turns that resend a growing context, with more context than the GPU holds: with the
    tier every turn's output is what the model gives (the fake reads its history from the
    blocks, so a block loaded late or stored after it was overwritten changes the tokens), and
    the turns find their earlier context on the host."""
    outputs = {}
    for num_host_blocks in (0, 64):
        engine, runner = make_engine(
            num_gpu_blocks=24,
            budget=32,
            max_model_len=256,
            async_scheduling=async_scheduling,
            num_host_blocks=num_host_blocks,
        )
        contexts = {s: [s * 10 + i for i in range(20)] for s in range(1, 4)}
        found: dict[str, list[int]] = {}
        for turn in range(4):
            for session, context in contexts.items():
                rid = f"s{session}t{turn}"
                engine.add_request(
                    rid, list(context), SamplingParams(max_tokens=6, temperature=0.0)
                )
                out = tokens_of(run_all(engine)[rid])
                assert out == rollout(context, 6), rid
                found[rid] = out
                context.extend(out + [session * 7 + turn + j for j in range(9)])
        stats = engine.stats()
        outputs[num_host_blocks] = found
        if num_host_blocks:
            assert stats.prefix_cache_host_hits > 0
            assert stats.num_host_blocks_used <= num_host_blocks
            assert runner.num_copies_applied > 0
        else:
            assert stats.prefix_cache_host_hits == 0
            assert stats.prefix_cache_evicted_misses > 0
    assert outputs[0] == outputs[64]


def test_the_tier_needs_prefix_caching() -> None:
    with pytest.raises(AssertionError, match="needs prefix caching"):
        KVCacheManager(
            5, 8, enable_prefix_caching=False, prefix_cache_max_fraction=0.5, num_host_blocks=4
        )
