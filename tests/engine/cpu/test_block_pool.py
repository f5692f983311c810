"""BlockPool: exact block ids through allocation, sharing, caching and eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagekeeper_engine.core.block_pool import NULL_BLOCK_ID, BlockPool

H1, H2, H3, H4 = b"h1", b"h2", b"h3", b"h4"


def test_allocates_in_order_and_never_hands_out_the_null_block() -> None:
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert NULL_BLOCK_ID == 0
    assert pool.num_free_blocks == 0
    assert pool.num_used_blocks == 5


def test_cpu_pool_without_null_block_uses_block_zero() -> None:
    pool = BlockPool(3, reserve_null_block=False)
    assert pool.allocate(3) == [0, 1, 2]


def test_freed_blocks_are_reused_first_in_first_out() -> None:
    pool = BlockPool(6)
    pool.allocate(3)
    pool.free([3, 1])
    assert pool.num_free_blocks == 4
    assert pool.allocate(4) == [4, 5, 3, 1]


def test_reference_counts_keep_shared_blocks_in_use() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert pool.num_used_blocks == 1
    pool.free([block])
    assert pool.ref_count(block) == 0
    assert pool.num_free_blocks == 3


def test_freed_cached_block_stays_findable_until_reclaimed() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    pool.cache_block(2, H1)
    pool.free([1, 2])
    assert pool.num_cached_blocks == 1
    assert pool.num_evictable_blocks == 1
    assert pool.lookup(H1) == 2
    # uncached free blocks go first: block 2's contents survive two allocations
    assert pool.allocate(2) == [3, 1]
    assert pool.lookup(H1) == 2
    assert pool.allocate(1) == [2]
    assert pool.lookup(H1) is None
    assert pool.block_hash(2) is None
    assert pool.num_evictions == 1


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [1, 2, 3]
    for block, block_hash in [(1, H1), (2, H2), (3, H3)]:
        pool.cache_block(block, block_hash)
    pool.free([3, 1, 2])
    assert pool.evictable_block_ids() == [3, 1, 2]
    assert pool.allocate(2) == [3, 1]
    assert (pool.lookup(H3), pool.lookup(H1), pool.lookup(H2)) == (None, None, 2)


def test_touch_revives_an_evictable_block() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [1, 2]
    pool.cache_block(1, H1)
    pool.cache_block(2, H2)
    pool.free([1, 2])
    assert pool.lookup(H2) == 2
    pool.touch([2])
    assert pool.ref_count(2) == 1
    assert pool.evictable_block_ids() == [1]
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [1]
    assert pool.lookup(H2) == 2


def test_bound_on_cache_only_blocks_evicts_oldest_at_free_time() -> None:
    pool = BlockPool(6, max_evictable_blocks=2)
    assert pool.allocate(4) == [1, 2, 3, 4]
    for block, block_hash in zip([1, 2, 3, 4], [H1, H2, H3, H4], strict=True):
        pool.cache_block(block, block_hash)
    pool.free([4, 3, 2, 1])
    assert pool.evictable_block_ids() == [2, 1]
    assert pool.num_evictable_blocks == 2
    assert pool.num_evictions == 2
    assert (pool.lookup(H1), pool.lookup(H2), pool.lookup(H3), pool.lookup(H4)) == (
        1,
        2,
        None,
        None,
    )
    # evicted blocks join the free list behind the never-used block 5
    assert pool.allocate(3) == [5, 4, 3]


def test_a_second_block_with_known_contents_stays_private() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    pool.cache_block(1, H1)
    pool.cache_block(2, H1)
    assert pool.lookup(H1) == 1
    assert pool.block_hash(2) is None
    pool.free([2])
    assert pool.evictable_block_ids() == []
    assert pool.num_free_blocks == 2


def test_invariant_violations_assert() -> None:
    pool = BlockPool(3)
    with pytest.raises(AssertionError, match="asked for 3 blocks with 2 free"):
        pool.allocate(3)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block])
    with pytest.raises(AssertionError, match="cannot cache free block"):
        pool.cache_block(block, H1)


def test_core_and_front_end_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import pagekeeper_engine.core.scheduler, pagekeeper_engine.core.stats\n"
        "import pagekeeper_engine.loop.engine, pagekeeper_engine.loop.engine_core\n"
        "import pagekeeper_engine.frontend.lifecycle, pagekeeper_engine.cli\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
