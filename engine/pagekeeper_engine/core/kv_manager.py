"""GPU KV blocks of every sequence: allocation, prefix caching by chained block hashes over
the GPU and the host tier, counters.

Pure Python; never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagekeeper_engine.core.block_hash import hash_block
from pagekeeper_engine.core.block_pool import BlockPool
from pagekeeper_engine.core.host_tier import EvictedRecord, HostTier
from pagekeeper_engine.core.kv_copies import CopyPlan
from pagekeeper_engine.core.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventLog, Medium
from pagekeeper_engine.core.sequence import Sequence

__all__ = ["KVCacheManager", "PrefixHit", "hash_block", "num_blocks_for"]

_ROOT_HASH = b""


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PrefixHit:
    """The longest cached prefix of a sequence's full blocks, block by block: the GPU block
    holding it, or (where only the host tier does) the host block to load it from."""

    gpu_ids: list[int] = field(default_factory=list)  # -1 where the host tier holds the block
    host_ids: list[int] = field(default_factory=list)  # -1 where the GPU holds the block

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_ids)

    @property
    def num_host_blocks(self) -> int:
        return sum(1 for host_id in self.host_ids if host_id >= 0)

    def append(self, gpu_id: int, host_id: int) -> None:
        self.gpu_ids.append(gpu_id)
        self.host_ids.append(host_id)


class KVCacheManager:
    """Maps sequences to GPU blocks and shares full blocks between equal prefixes.

    Prefix caching: the full blocks of a prompt are looked up by chained hash, longest prefix
    first, never the whole prompt (the last token must be computed to produce logits). Blocks a
    sequence computes are registered as they fill. The blocks held only by the cache are bounded
    by `prefix_cache_max_fraction` of the pool (oldest evicted first).

    Counters are in tokens: `num_prefix_queries` (tokens looked up at admission) and
    `num_prefix_hits` (of those, tokens found cached).

    The host tier (`num_host_blocks` > 0, prefix caching on): every block registered in the GPU
    prefix cache is also stored in host memory (written through, on a side stream: `kv_copies`),
    so a block the GPU cache evicts stays findable there; a prefix found only there is loaded
    back into new GPU blocks at admission (`num_prefix_host_hits` tokens). A hit on either tier
    refreshes the host copy's place in its LRU. `num_evicted_misses` counts tokens of full
    blocks that no tier held any more when a request asked for them again, within a record of
    as many hashes as both tiers hold together (what a cache of twice the size could have
    kept): the evidence for a host tier, or a larger one.

    With `events` set, every block a tier registers or drops is recorded there (`kv_events`).

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
        num_host_blocks: int = 0,
    ) -> None:
        assert 0.0 <= prefix_cache_max_fraction <= 1.0, prefix_cache_max_fraction
        assert num_host_blocks == 0 or enable_prefix_caching, "a host tier needs prefix caching"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        usable = num_blocks - 1  # the pool reserves the null block
        max_evictable = int(prefix_cache_max_fraction * usable) if enable_prefix_caching else 0
        self.pool = BlockPool(
            num_blocks, max_evictable_blocks=max_evictable, on_evict=self._evicted_from_gpu
        )
        self.host = HostTier(num_host_blocks) if num_host_blocks > 0 else None
        self.copies = CopyPlan()
        self.evicted = EvictedRecord(usable + num_host_blocks if enable_prefix_caching else 0)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_host_hits = 0
        self.num_evicted_misses = 0
        self.num_prefix_shadow_hits = 0
        self._max_shadow_hashes = usable
        self._shadow_hashes: OrderedDict[bytes, None] = OrderedDict()
        self.events: KVEventLog | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest prefix of `seq.token_ids`' full blocks that either tier holds, not yet
        referenced; never the whole prompt (its last token must be computed for logits)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        host = self.host
        for block_hash in seq.block_hashes[:num_full]:
            block_id = self.pool.lookup(block_hash)
            if block_id is not None:
                hit.append(block_id, -1)
                continue
            host_id = host.lookup(block_hash) if host is not None else None
            if host_id is None:
                break
            hit.append(-1, host_id)
        return hit

    def num_blocks_to_admit(self, seq: Sequence, hit: PrefixHit) -> int:
        """Free blocks admitting `seq` would consume: new blocks for all of its tokens beyond
        the GPU's cached prefix (the host tier's blocks load into new ones), plus cached blocks
        that are evictable now (they count as free)."""
        gpu_ids = [b for b in hit.gpu_ids if b >= 0]
        num_new = num_blocks_for(seq.num_tokens, self.block_size) - len(gpu_ids)
        num_revived = sum(1 for b in gpu_ids if self.pool.ref_count(b) == 0)
        return num_new + num_revived

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give `seq` (holding no blocks) the cached prefix plus new blocks for all its tokens;
        the host tier's blocks of the prefix load into new GPU blocks (`copies`), and `seq`
        reads nothing before those loads are done (in this step behind a LOADS fence, or in a
        later one when a load must go late)."""
        assert not seq.block_ids, f"{seq.request_id} already holds blocks"
        gpu_hits = [b for b in hit.gpu_ids if b >= 0]
        self.pool.touch(gpu_hits)
        num_new = num_blocks_for(seq.num_tokens, self.block_size) - len(gpu_hits)
        new_ids = self._allocate(num_new)
        block_ids = []
        taken = 0
        for index, (hit_id, host_id) in enumerate(zip(hit.gpu_ids, hit.host_ids, strict=True)):
            block_hash = seq.block_hashes[index]
            if hit_id >= 0:
                if self.host is not None:
                    self.host.touch(block_hash)
                block_ids.append(hit_id)
                continue
            assert self.host is not None
            gpu_id, taken = new_ids[taken], taken + 1
            if self.pool.cache_block(gpu_id, block_hash) and self.events is not None:
                self._record_stored(seq, index, MEDIUM_GPU)
            self.host.note_loaded(block_hash)
            self.copies.load(host_id, gpu_id)
            block_ids.append(gpu_id)
        seq.block_ids = block_ids + new_ids[taken:]
        self.copies.reads(seq.request_id, block_ids)
        seq.num_computed_tokens = hit.num_blocks * self.block_size
        seq.num_registered_blocks = hit.num_blocks
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_computed_tokens
            self.num_prefix_host_hits += taken * self.block_size
            self._count_evicted_misses(seq, hit.num_blocks)
        elif not seq.block_hashes:  # hashed once: a preempted sequence's return is no repeat
            self._count_shadow_hits(seq)

    def _count_evicted_misses(self, seq: Sequence, num_hit_blocks: int) -> None:
        num_full = (seq.num_tokens - 1) // self.block_size
        for block_hash in seq.block_hashes[num_hit_blocks:num_full]:
            if block_hash not in self.evicted:
                break
            self.num_evicted_misses += self.block_size

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
            seq.block_ids.extend(self._allocate(num_blocks))

    def allocate_for_swap_in(self, seq: Sequence) -> list[int]:
        """Fresh GPU blocks covering all of `seq`'s tokens (the caller frees its CPU blocks)."""
        return self._allocate(num_blocks_for(seq.num_tokens, self.block_size))

    def _allocate(self, num_blocks: int) -> list[int]:
        """Blocks for new data: any host-tier copy still running on one is fenced first."""
        block_ids = self.pool.allocate(num_blocks)
        self.copies.allocated(block_ids)
        return block_ids

    def free(self, seq: Sequence) -> None:
        """Release the sequence's GPU blocks, last block first (see BlockPool.free); a step
        still in flight may use them (`copies.freed`)."""
        self.copies.freed(seq.block_ids)
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
            block_id, block_hash = seq.block_ids[index], seq.block_hashes[index]
            if self.pool.cache_block(block_id, block_hash):
                self.evicted.discard(block_hash)
                if self.events is not None:
                    self._record_stored(seq, index, MEDIUM_GPU)
                if self._store(block_id, block_hash) and self.events is not None:
                    self._record_stored(seq, index, MEDIUM_CPU)
        seq.num_registered_blocks = num_full

    def _store(self, block_id: int, block_hash: bytes) -> bool:
        """Write a newly registered block through to the host tier (`kv_copies`); whether the
        tier took a new copy."""
        if self.host is None:
            return False
        stored = self.host.store(block_hash)
        if stored is None:  # the host tier has it already
            return False
        host_id, pushed_out = stored
        self.copies.store(block_id, host_id)
        if pushed_out is not None:
            if self.events is not None:
                self.events.removed(pushed_out, MEDIUM_CPU)
            if self.pool.lookup(pushed_out) is None:
                self.evicted.add(pushed_out)
        return True

    def _record_stored(self, seq: Sequence, index: int, medium: Medium) -> None:
        assert self.events is not None
        size = self.block_size
        parent = seq.block_hashes[index - 1] if index > 0 else None
        tokens = seq.token_ids[index * size : (index + 1) * size]
        self.events.stored(seq.block_hashes[index], parent, tokens, medium)

    def _evicted_from_gpu(self, block_hash: bytes) -> None:
        if self.events is not None:
            self.events.removed(block_hash, MEDIUM_GPU)
        if self.host is None or block_hash not in self.host:
            self.evicted.add(block_hash)

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
