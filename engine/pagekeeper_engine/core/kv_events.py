"""KV cache events as plain data: which full blocks each medium of the prefix cache gained and
lost, the facts a KV-aware router needs to know where a prefix lives.

Pure Python; never imports torch or zmq. The KV manager records into a `KVEventLog` as blocks
are registered and evicted; the step loop takes each step's events and hands them to a
`KVEventSink` (the engine core process's publisher, which puts them on the wire in vLLM's
format, off the step's critical path).

Per medium the events say exactly what the medium holds: replaying them from the start (or
from the last `AllBlocksCleared`) gives the set of hashes registered there. A block is stored
on the GPU when it is registered in the prefix cache (computed, or loaded from the host tier),
removed when the cache drops it; on the CPU when the host tier takes a copy, removed when its
LRU pushes the copy out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

Medium = Literal["GPU", "CPU"]
MEDIUM_GPU: Medium = "GPU"
MEDIUM_CPU: Medium = "CPU"


@dataclass
class BlockStored:
    """Consecutive full blocks of one sequence, each the child of the one before it; the first
    one's parent is `parent_block_hash` (None: the sequence's first block)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # block_size per block, in order
    block_size: int
    medium: Medium


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: Medium


@dataclass
class AllBlocksCleared:
    """Forget every block of every medium this engine reported."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    """Where the step loop hands each step's events; `publish` must not block. It counts the
    events it sent and those it had to drop."""

    @property
    def num_published(self) -> int: ...

    @property
    def num_dropped(self) -> int: ...

    def publish(self, events: list[KVEvent]) -> None: ...

    def close(self) -> None: ...


@dataclass
class KVEventLog:
    """The events since the last `take`, in order per medium.

    A store that continues the newest store of its medium's chain (its parent is that event's
    last block), with no other event of that medium between, extends that event; likewise
    consecutive removals of one medium share an event. Order between media is not kept (a
    router keys blocks by medium). After `close` (a drain) nothing more is recorded: a router
    must not learn of blocks on an engine that is going away.
    """

    block_size: int
    events: list[KVEvent] = field(default_factory=list)
    is_closed: bool = False
    # the index in `events` of each medium's newest event
    _newest: dict[Medium, int] = field(default_factory=dict)

    def stored(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: list[int],
        medium: Medium,
    ) -> None:
        if self.is_closed:
            return
        assert len(token_ids) == self.block_size, (
            f"a stored block has {len(token_ids)} tokens, not {self.block_size}"
        )
        newest = self._newest_of(medium)
        if (
            isinstance(newest, BlockStored)
            and parent_hash is not None
            and newest.block_hashes[-1] == parent_hash
        ):
            newest.block_hashes.append(block_hash)
            newest.token_ids.extend(token_ids)
            return
        self._append(
            BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, medium),
            medium,
        )

    def removed(self, block_hash: bytes, medium: Medium) -> None:
        if self.is_closed:
            return
        newest = self._newest_of(medium)
        if isinstance(newest, BlockRemoved):
            newest.block_hashes.append(block_hash)
            return
        self._append(BlockRemoved([block_hash], medium), medium)

    def cleared(self) -> None:
        """Every medium was emptied (what came before in this step still arrives first)."""
        if self.is_closed:
            return
        self.events.append(AllBlocksCleared())
        self._newest.clear()

    def close(self) -> None:
        """Report every block gone and record nothing more."""
        self.cleared()
        self.is_closed = True

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events, []
        self._newest.clear()
        return events

    def _newest_of(self, medium: Medium) -> KVEvent | None:
        index = self._newest.get(medium)
        return None if index is None else self.events[index]

    def _append(self, event: KVEvent, medium: Medium) -> None:
        self._newest[medium] = len(self.events)
        self.events.append(event)
