"""GPU KV blocks of every sequence: allocation, prefix caching by chained block hashes, counters.

Pure Python; never imports torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from pagekeeper_engine.core.block_pool import BlockPool
from pagekeeper_engine.core.sequence import Sequence

_ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full block: it names the block's tokens and everything before them.

    A 128-bit digest rather than Python's `hash`: a collision would silently serve another
    prompt's keys and values.
    """
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps sequences to GPU blocks and shares full blocks between equal prefixes.

    Prefix caching: the full blocks of a prompt are looked up by chained hash, longest prefix
    first, never the whole prompt (the last token must be computed to produce logits). Blocks a
    sequence computes are registered as they fill. The blocks held only by the cache are bounded
    by `prefix_cache_max_fraction` of the pool (oldest evicted first).

    Counters are in tokens: `num_prefix_queries` (tokens looked up at admission) and
    `num_prefix_hits` (of those, tokens found cached).

    With prefix caching off, `num_prefix_shadow_hits` counts the tokens a cache would have
    found: at a prompt's first admission, its longest prefix of full blocks whose chained hashes
    an earlier prompt had, against a record of the most recent hashes no longer than the pool
    (what a cache could have held). The cost is what caching on pays at admission (one hash a
    full block); the step loop itself is untouched. It is the evidence for turning caching on.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool,
        prefix_cache_max_fraction: float,
    ) -> None:
        assert 0.0 <= prefix_cache_max_fraction <= 1.0, prefix_cache_max_fraction
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        usable = num_blocks - 1  # the pool reserves the null block
        max_evictable = int(prefix_cache_max_fraction * usable) if enable_prefix_caching else 0
        self.pool = BlockPool(num_blocks, max_evictable_blocks=max_evictable)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_shadow_hits = 0
        self._max_shadow_hashes = usable
        self._shadow_hashes: OrderedDict[bytes, None] = OrderedDict()

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq.token_ids`, not yet referenced."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        block_ids = []
        for block_hash in seq.block_hashes[:num_full]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_blocks_to_admit(self, seq: Sequence, cached_block_ids: list[int]) -> int:
        """Free blocks admitting `seq` would consume: new blocks for all of its tokens beyond
        the cached prefix, plus cached blocks that are evictable now (they count as free)."""
        num_new = num_blocks_for(seq.num_tokens, self.block_size) - len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if self.pool.ref_count(b) == 0)
        return num_new + num_revived

    def admit(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Give `seq` (holding no blocks) the cached prefix plus new blocks for all its tokens."""
        assert not seq.block_ids, f"{seq.request_id} already holds blocks"
        self.pool.touch(cached_block_ids)
        num_new = num_blocks_for(seq.num_tokens, self.block_size) - len(cached_block_ids)
        seq.block_ids = cached_block_ids + self.pool.allocate(num_new)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        seq.num_registered_blocks = len(cached_block_ids)
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_computed_tokens
        elif not seq.block_hashes:  # hashed once: a preempted sequence's return is no repeat
            self._count_shadow_hits(seq)

    def _count_shadow_hits(self, seq: Sequence) -> None:
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        seen, is_prefix = self._shadow_hashes, True
        for block_hash in seq.block_hashes[:num_full]:
            if block_hash in seen:
                seen.move_to_end(block_hash)
                if is_prefix:
                    self.num_prefix_shadow_hits += self.block_size
            else:
                is_prefix = False
                seen[block_hash] = None
        while len(seen) > self._max_shadow_hashes:
            seen.popitem(last=False)

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        total = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_ids))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq, num_new_tokens) <= self.pool.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover `num_new_tokens` more computed tokens."""
        num_blocks = self.num_blocks_to_append(seq, num_new_tokens)
        if num_blocks:
            seq.block_ids.extend(self.pool.allocate(num_blocks))

    def allocate_for_swap_in(self, seq: Sequence) -> list[int]:
        """Fresh GPU blocks covering all of `seq`'s tokens (the caller frees its CPU blocks)."""
        return self.pool.allocate(num_blocks_for(seq.num_tokens, self.block_size))

    def free(self, seq: Sequence) -> None:
        """Release the sequence's GPU blocks, last block first (see BlockPool.free)."""
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the blocks that became full of computed tokens since the last call; only
        within the first `num_tokens` tokens when given (tokens whose values are known)."""
        if not self.enable_prefix_caching:
            return
        num_cacheable = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(num_cacheable, seq.num_computed_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            self.pool.cache_block(seq.block_ids[index], seq.block_hashes[index])
        seq.num_registered_blocks = num_full

    def internal_fragmentation(self, seqs: Iterable[Sequence]) -> float:
        """Unused slots in partly filled last blocks over allocated (in-use) slots.

        Shared blocks are full, so each partial block belongs to one sequence; blocks reserved
        for a prompt's later chunks count as filled (they are, within the step that computes
        them).
        """
        num_allocated_slots = self.pool.num_used_blocks * self.block_size
        if num_allocated_slots == 0:
            return 0.0
        num_unused = 0
        for seq in seqs:
            capacity = len(seq.block_ids) * self.block_size
            num_unused += capacity - min(seq.num_tokens, capacity)
        return num_unused / num_allocated_slots

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        size = self.block_size
        for index in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[index * size : (index + 1) * size]))
