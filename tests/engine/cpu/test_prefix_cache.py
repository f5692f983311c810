"""KVCacheManager: chained block hashes, longest-prefix hits, eviction order, the cache bound."""

from __future__ import annotations

from pagekeeper_engine.core.kv_manager import KVCacheManager, PrefixHit, hash_block
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import Sequence

BS = 4


def make_kv(num_blocks: int = 17, fraction: float = 1.0, enabled: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, enable_prefix_caching=enabled, prefix_cache_max_fraction=fraction
    )


def seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams())


def run_prefill(kv: KVCacheManager, s: Sequence) -> None:
    """Admit with whatever is cached and mark every prompt token computed."""
    kv.admit(s, kv.find_cached_prefix(s))
    s.num_computed_tokens = s.num_tokens
    kv.cache_computed_blocks(s)


def test_hash_chains_on_the_parent() -> None:
    a = hash_block(b"", [1, 2, 3, 4])
    assert a == hash_block(b"", [1, 2, 3, 4])
    assert len(a) == 32  # SHA-256, as vLLM's sha256_cbor
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4]) != hash_block(b"", [1, 2, 3, 5])


def test_longest_prefix_hit_and_counters() -> None:
    kv = make_kv()
    a = seq("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    run_prefill(kv, a)
    assert a.block_ids == [1, 2, 3]
    assert a.num_registered_blocks == 2
    assert kv.pool.num_cached_blocks == 2
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (10, 0)

    b = seq("b", [*range(8), 99, 98, 97])
    cached = kv.find_cached_prefix(b)
    assert cached.gpu_ids == [1, 2]
    assert kv.num_blocks_to_admit(b, cached) == 1  # both cached blocks are in use: not free
    kv.admit(b, cached)
    assert b.block_ids == [1, 2, 4]
    assert b.num_computed_tokens == 8
    assert (kv.pool.ref_count(1), kv.pool.ref_count(2), kv.pool.ref_count(4)) == (2, 2, 1)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (21, 8)

    c = seq("c", [0, 1, 2, 3, 50, 5, 6, 7, 8])  # differs in block 2: only block 1 matches
    assert kv.find_cached_prefix(c).gpu_ids == [1]


def test_whole_prompt_is_never_a_hit() -> None:
    kv = make_kv()
    run_prefill(kv, seq("a", list(range(8))))
    again = seq("b", list(range(8)))
    assert kv.find_cached_prefix(again).gpu_ids == [1]  # the last token must be computed for logits
    longer = seq("c", list(range(9)))
    assert kv.find_cached_prefix(longer).gpu_ids == [1, 2]


def test_revived_blocks_count_as_consumed_free_blocks() -> None:
    kv = make_kv(num_blocks=6)
    a = seq("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 5
    b = seq("b", list(range(10)))
    cached = kv.find_cached_prefix(b)
    assert cached.gpu_ids == [1, 2]
    assert kv.num_blocks_to_admit(b, cached) == 3  # 1 new + 2 evictable taken off the free count
    kv.admit(b, cached)
    assert kv.num_free_blocks == 2


def test_blocks_register_as_chunks_fill_them() -> None:
    kv = make_kv()
    a = seq("a", list(range(11)))
    kv.admit(a, PrefixHit())
    assert a.block_ids == [1, 2, 3]
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)
    assert a.num_registered_blocks == 1
    assert kv.pool.lookup(a.block_hashes[0]) == 1
    a.num_computed_tokens = 11
    kv.cache_computed_blocks(a)
    assert a.num_registered_blocks == 2
    assert kv.pool.lookup(a.block_hashes[1]) == 2
    # generated tokens extend the chain
    a.append_token(11, None)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    assert a.num_registered_blocks == 3
    assert kv.pool.lookup(a.block_hashes[2]) == 3
    assert a.block_hashes[2] == hash_block(a.block_hashes[1], [8, 9, 10, 11])


def test_freed_sequence_loses_its_last_blocks_first() -> None:
    kv = make_kv(num_blocks=5)
    a = seq("a", list(range(13)))  # 3 full blocks cached + 1 partial
    run_prefill(kv, a)
    assert a.block_ids == [1, 2, 3, 4]
    kv.free(a)
    assert kv.pool.evictable_block_ids() == [3, 2, 1]
    kv.append_slots(other := seq("x", [7]), 1)  # the partial block 4 is free: no eviction
    assert other.block_ids == [4]
    other.num_computed_tokens = 1
    kv.append_slots(other, 4)
    assert other.block_ids == [4, 3]
    b = seq("b", list(range(13)))
    assert kv.find_cached_prefix(b).gpu_ids == [1, 2]


def test_cache_only_blocks_are_bounded_by_the_fraction() -> None:
    kv = make_kv(num_blocks=9, fraction=0.25)  # 8 usable -> at most 2 cache-only blocks
    assert kv.pool.max_evictable_blocks == 2
    a = seq("a", list(range(17)))  # 4 full blocks
    run_prefill(kv, a)
    assert kv.pool.num_cached_blocks == 4
    kv.free(a)
    assert kv.pool.num_evictable_blocks == 2
    assert kv.pool.evictable_block_ids() == [2, 1]
    assert kv.pool.num_free_blocks == 8
    assert kv.find_cached_prefix(seq("b", list(range(17)))).gpu_ids == [1, 2]


def test_disabled_prefix_caching_neither_finds_nor_keeps() -> None:
    kv = make_kv(enabled=False, fraction=0.5)
    a = seq("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.pool.num_cached_blocks == 0
    kv.free(a)
    assert kv.find_cached_prefix(seq("b", list(range(9)))).gpu_ids == []
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)


def test_internal_fragmentation_counts_unused_slots_of_last_blocks() -> None:
    kv = make_kv()
    a = seq("a", list(range(5)))  # 2 blocks, 3 unused slots
    b = seq("b", list(range(100, 108)))  # 2 full blocks
    kv.admit(a, PrefixHit())
    kv.admit(b, PrefixHit())
    assert kv.internal_fragmentation([a, b]) == 3 / 16
    # a shared prefix block counts once among the allocated slots
    kv.free(b)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    c = seq("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    kv.admit(c, kv.find_cached_prefix(c))
    assert c.block_ids[0] == a.block_ids[0]
    assert kv.internal_fragmentation([a, c]) == (3 + 3) / (4 * BS)
    assert make_kv().internal_fragmentation([]) == 0.0


def test_with_caching_off_repeated_prefixes_are_counted_not_cached() -> None:
    kv = make_kv(num_blocks=5, enabled=False)  # 4 usable blocks: at most 4 hashes remembered
    a = seq("a", list(range(10)))  # full blocks [0..3] [4..7]
    run_prefill(kv, a)
    assert kv.num_prefix_shadow_hits == 0
    assert kv.pool.num_cached_blocks == 0
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)
    kv.free(a)
    b = seq("b", [*range(8), 99, 98, 97])  # repeats both of a's full blocks
    run_prefill(kv, b)
    assert kv.num_prefix_shadow_hits == 8
    assert (b.block_ids, kv.pool.num_cached_blocks) == ([4, 3, 2], 0)  # three new blocks
    kv.free(b)
    c = seq("c", [0, 1, 2, 3, 50, 5, 6, 7, 8])  # only its first block repeats
    run_prefill(kv, c)
    assert kv.num_prefix_shadow_hits == 12


def test_a_preempted_sequence_coming_back_is_no_repeat() -> None:
    kv = make_kv(enabled=False)
    a = seq("a", list(range(10)))
    run_prefill(kv, a)
    kv.free(a)  # preempted by recompute: admitted again with the same tokens
    run_prefill(kv, a)
    assert kv.num_prefix_shadow_hits == 0


def test_the_shadow_record_is_no_longer_than_the_pool() -> None:
    kv = make_kv(num_blocks=4, enabled=False)  # 3 usable blocks: 3 hashes remembered
    run_prefill(kv, a := seq("a", list(range(9))))  # hashes h1, h2
    kv.free(a)
    run_prefill(kv, b := seq("b", list(range(100, 109))))  # h3, h4 push h1 out
    kv.free(b)
    run_prefill(kv, seq("c", list(range(9))))
    assert kv.num_prefix_shadow_hits == 0
