"""KV cache events from the pure core: exact hashes, parents, tokens and media for stores,
evictions, the host tier and a clear."""

from __future__ import annotations

from pagekeeper_engine.core.block_hash import ROOT_HASH, external_block_hash, hash_block
from pagekeeper_engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from pagekeeper_engine.core.kv_manager import KVCacheManager
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import Sequence

BS = 4


def make_kv(
    num_blocks: int = 17, fraction: float = 1.0, num_host_blocks: int = 0
) -> KVCacheManager:
    kv = KVCacheManager(
        num_blocks,
        BS,
        enable_prefix_caching=True,
        prefix_cache_max_fraction=fraction,
        num_host_blocks=num_host_blocks,
    )
    kv.events = KVEventLog(BS)
    return kv


def prefill(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> Sequence:
    seq = Sequence(request_id, token_ids, SamplingParams())
    kv.admit(seq, kv.find_cached_prefix(seq))
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return seq


def take(kv: KVCacheManager) -> list[object]:
    assert kv.events is not None
    return list(kv.events.take())


def chain(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - len(token_ids) % BS, BS):
        hashes.append(hash_block(hashes[-1] if hashes else b"", token_ids[start : start + BS]))
    return hashes


def test_the_hash_chain_starts_at_the_seeded_root() -> None:
    h0 = hash_block(b"", [1, 2, 3, 4])
    assert h0 == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert len(h0) == 32
    assert external_block_hash(h0) == int.from_bytes(h0[-8:], "big")


def test_full_blocks_are_stored_once_as_one_chain_per_step() -> None:
    kv = make_kv()
    a = prefill(kv, "a", list(range(10)))  # blocks [0..3] [4..7] and 2 tokens
    h = chain(list(range(12)))
    assert a.block_hashes == h[:2]
    assert take(kv) == [BlockStored(h[:2], None, list(range(8)), BS, "GPU")]
    a.append_token(10, None)
    a.append_token(11, None)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    assert take(kv) == [BlockStored([h[2]], h[1], [8, 9, 10, 11], BS, "GPU")]
    assert take(kv) == []
    # the same prefix computed again is a hit (no event); the same blocks computed twice at
    # once register once
    b = prefill(kv, "b", [*range(8), 99])
    assert b.block_ids[:2] == a.block_ids[:2]
    twin = Sequence("twin", [*range(8), 42, 43, 44, 45, 46], SamplingParams())
    kv.admit(twin, kv.find_cached_prefix(twin))
    twin.num_computed_tokens = twin.num_tokens
    kv.cache_computed_blocks(twin)
    assert take(kv) == [
        BlockStored(chain([*range(8), 42, 43, 44, 45])[2:], h[1], [42, 43, 44, 45], BS, "GPU")
    ]


def test_evictions_are_removals_in_eviction_order() -> None:
    kv = make_kv(num_blocks=9, fraction=0.25)  # 8 usable blocks, at most 2 held by the cache
    a = prefill(kv, "a", list(range(17)))  # 4 full blocks
    h = a.block_hashes
    take(kv)
    kv.free(a)  # last first: blocks of h3 and h2 go over the bound
    assert take(kv) == [BlockRemoved([h[3], h[2]], "GPU")]
    b = prefill(kv, "b", list(range(100, 132)))  # 8 blocks: reclaims the last two cached ones
    hb = b.block_hashes
    assert take(kv) == [
        BlockRemoved([h[1], h[0]], "GPU"),
        BlockStored(hb, None, list(range(100, 132)), BS, "GPU"),
    ]
    assert kv.pool.num_cached_blocks == 8


def test_the_host_tier_reports_its_own_medium() -> None:
    kv = make_kv(num_blocks=5, num_host_blocks=2)
    a = prefill(kv, "a", list(range(13)))  # 3 full blocks; the host keeps the newest 2
    h = a.block_hashes
    assert take(kv) == [
        BlockStored(h, None, list(range(12)), BS, "GPU"),
        BlockStored(h[:2], None, list(range(8)), BS, "CPU"),
        BlockRemoved([h[0]], "CPU"),
        BlockStored([h[2]], h[1], [8, 9, 10, 11], BS, "CPU"),
    ]
    kv.free(a)
    b = prefill(kv, "b", list(range(200, 216)))  # 4 blocks: evicts all of a's from the GPU
    hb = b.block_hashes
    events = take(kv)
    assert events[0] == BlockRemoved([h[2], h[1], h[0]], "GPU")
    assert events[1] == BlockStored(hb, None, list(range(200, 216)), BS, "GPU")
    # the host's LRU (2 blocks) pushes out one copy for each new one
    assert events[2:] == [
        BlockRemoved([h[1]], "CPU"),
        BlockStored([hb[0]], None, list(range(200, 204)), BS, "CPU"),
        BlockRemoved([h[2]], "CPU"),
        BlockStored([hb[1]], hb[0], list(range(204, 208)), BS, "CPU"),
        BlockRemoved([hb[0]], "CPU"),
        BlockStored([hb[2]], hb[1], list(range(208, 212)), BS, "CPU"),
        BlockRemoved([hb[1]], "CPU"),
        BlockStored([hb[3]], hb[2], list(range(212, 216)), BS, "CPU"),
    ]


def test_a_prefix_loaded_from_the_host_is_stored_on_the_gpu_again() -> None:
    kv = make_kv(num_blocks=6, fraction=0.0, num_host_blocks=8)
    a = prefill(kv, "a", list(range(9)))
    h = a.block_hashes
    kv.free(a)  # the GPU cache may hold nothing: both go at once
    assert take(kv) == [
        BlockStored(h, None, list(range(8)), BS, "GPU"),
        BlockStored(h, None, list(range(8)), BS, "CPU"),
        BlockRemoved([h[1], h[0]], "GPU"),
    ]
    prefill(kv, "b", [*range(8), 50])
    assert take(kv) == [BlockStored(h, None, list(range(8)), BS, "GPU")]


def test_a_clear_comes_after_the_steps_events_and_closing_records_nothing_more() -> None:
    kv = make_kv()
    a = prefill(kv, "a", list(range(5)))
    assert kv.events is not None
    kv.events.close()
    kv.free(a)
    prefill(kv, "b", list(range(50, 59)))
    assert take(kv) == [
        BlockStored(a.block_hashes, None, [0, 1, 2, 3], BS, "GPU"),
        AllBlocksCleared(),
    ]
    assert take(kv) == []
