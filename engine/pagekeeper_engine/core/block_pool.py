"""A fixed set of KV-cache blocks: free list, reference counts and the prefix-cache hash map.

Pure Python; never imports torch. The model runner owns the tensors, this owns the ids.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

NULL_BLOCK_ID = 0


class BlockPool:
    """Hands out block ids, counts references, and keeps freed full blocks findable by hash.

    A block is in exactly one of three states:
    - in use: reference count > 0 (shared prefix blocks have count > 1);
    - evictable: count 0 but still registered under its hash, so a later request with the same
      prefix can reuse its contents. These sit in an LRU (`_evictable`, oldest first) and lose
      their hash only when reclaimed for new data or when the bound below pushes them out;
    - free: count 0, no hash (`_free_ids`, handed out first-in first-out).

    Allocation takes free blocks before evicting cached ones. `max_evictable_blocks` bounds the
    blocks held only by the prefix cache; freeing past it evicts the oldest at once. Each
    eviction hands the hash it drops to `on_evict` (the host tier's accounting).

    With `reserve_null_block` the GPU pool never hands out block 0: the runner may pad block
    tables and slot mappings with it (CUDA-graph padding, dummy rows) without touching a
    sequence's data. The CPU swap pool reserves nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        reserve_null_block: bool = True,
        max_evictable_blocks: int | None = None,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        first = 1 if reserve_null_block else 0
        assert num_blocks > first, f"a pool needs at least {first + 1} blocks, got {num_blocks}"
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - first
        self.max_evictable_blocks = (
            self.num_usable_blocks if max_evictable_blocks is None else max_evictable_blocks
        )
        self._free_ids: deque[int] = deque(range(first, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._id_of: dict[bytes, int] = {}
        self.num_evictions = 0
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._id_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held only by the prefix cache."""
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def evictable_block_ids(self) -> list[int]:
        """Evictable blocks, next to be evicted first."""
        return list(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks with reference count 1; the caller checked there are enough."""
        assert num_blocks <= self.num_free_blocks, (
            f"asked for {num_blocks} blocks with {self.num_free_blocks} free"
        )
        block_ids = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit), reviving evictable ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert block_id in self._evictable, f"block {block_id} is free and uncached"
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order: the first freed is evicted first.

        Callers free a sequence's blocks last-first, so its later blocks (useless without the
        earlier ones in the hash chain) leave the cache before its prefix.
        """
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if block_id in self._hash_of:
                self._evictable[block_id] = None
            else:
                self._free_ids.append(block_id)
        while len(self._evictable) > self.max_evictable_blocks:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(block_id)
            self._free_ids.append(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the full block with this chained hash, if cached."""
        return self._id_of.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register an in-use full block under its hash; whether it was registered now.

        When another block already holds the same contents (two sequences computed the same
        prefix at once) the first stays registered and this one stays private.
        """
        assert self._ref_counts[block_id] > 0, f"cannot cache free block {block_id}"
        if block_hash in self._id_of or block_id in self._hash_of:
            return False
        self._id_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id)
        del self._id_of[block_hash]
        self.num_evictions += 1
        if self._on_evict is not None:
            self._on_evict(block_hash)
