"""The prefix cache's second tier: copies of full KV blocks in pinned host memory, by hash.

Pure Python; never imports torch. The runner owns the host pool's bytes (`runner/kv_offload`);
this owns its ids. A host block is in one of two states:
- free (`_free_ids`, handed out first-in first-out, so stores made together tend to take
  consecutive ids and travel in one copy);
- stored: it holds the block whose chained hash maps to it (`_id_of`), and sits in the LRU
  (`_id_of`'s order, least recently used first). A store or a hit (on this tier or on the GPU
  copy of the same block) moves it to the newest end; a store that finds no free block takes
  the oldest one.

A block's copy is written once (when its hash is first stored) and only read after that, so a
load may read a block whose id the LRU has since handed to another hash: the runner issues a
step's loads before its stores, and every copy on one stream, in order.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class HostTier:
    """A bounded LRU of full blocks' copies in host memory, found by chained block hash."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, f"a host tier needs at least 1 block, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._id_of: OrderedDict[bytes, int] = OrderedDict()
        self.num_stored = 0  # blocks copied in
        self.num_loaded = 0  # blocks copied back to the GPU
        self.num_evicted = 0  # stored blocks pushed out for newer ones

    @property
    def num_used_blocks(self) -> int:
        return len(self._id_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._id_of

    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding this hash, if stored (no LRU change: see `touch`)."""
        return self._id_of.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """The block was used (found on either tier): it becomes the newest, if stored."""
        if block_hash in self._id_of:
            self._id_of.move_to_end(block_hash)

    def store(self, block_hash: bytes) -> tuple[int, bytes | None] | None:
        """A host block for a newly computed block: its id and the hash it pushed out (None when
        a free block took it). None when the hash is stored already (it is touched instead)."""
        if block_hash in self._id_of:
            self._id_of.move_to_end(block_hash)
            return None
        evicted = None
        if self._free_ids:
            host_id = self._free_ids.popleft()
        else:
            evicted, host_id = self._id_of.popitem(last=False)
            self.num_evicted += 1
        self._id_of[block_hash] = host_id
        self.num_stored += 1
        return host_id, evicted

    def note_loaded(self, block_hash: bytes) -> None:
        """A stored block is being copied back to the GPU: count it and make it the newest."""
        self.num_loaded += 1
        self._id_of.move_to_end(block_hash)

    def lru_hashes(self) -> list[bytes]:
        """Stored hashes, next to be pushed out first."""
        return list(self._id_of)


class EvictedRecord:
    """The hashes of full blocks no tier holds any more, newest last, at most `max_hashes` of
    them: a later request whose prefix runs into them recomputes what a larger cache would
    have kept (`pagekeeper_prefix_cache_evicted_misses_total`)."""

    def __init__(self, max_hashes: int) -> None:
        self.max_hashes = max(0, max_hashes)
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def add(self, block_hash: bytes) -> None:
        if self.max_hashes == 0:
            return
        self._hashes[block_hash] = None
        self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_hashes:
            self._hashes.popitem(last=False)

    def discard(self, block_hash: bytes) -> None:
        """The block is cached again (computed anew): no longer a loss."""
        self._hashes.pop(block_hash, None)
