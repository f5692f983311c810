"""The copies between the GPU KV pool and the host tier that one step carries, and the fence
that keeps the step's forward pass from racing them.

Pure Python; never imports torch. The runner issues a step's copies on two side streams: the
stores after the forward passes already enqueued (the blocks they store were computed there),
the loads at once, beside the step in flight, behind the earlier steps' stores only. A load
that may race the step in flight goes late instead, after those forward passes and this step's
stores (`late_loads`): its GPU block was freed since the last step was planned (that step may
still read or write it), or this step stores that block's old contents, or its host block is
being written by this step's store.

A copy touches its GPU block while it runs, so the forward pass must not use that block before
it is done. Instead of waiting for every copy, each step says how far its forward pass waits
(`CopyFence`):
- NONE: it writes no block a copy may still be in, and reads no block still loading;
- PREVIOUS: it waits for the copies of earlier steps (a sequence whose blocks an earlier step
  loaded runs now; a block stored or loaded earlier is reused for new data);
- LOADS: also for this step's early loads (a sequence whose prefix they load runs in this
  very step: the load overlaps the step in flight instead of costing a step of its own);
- ALL: also for this step's stores and late loads (a block stored this step is reused at once).

A sequence whose prefix a late load fills runs from the next step on, behind a PREVIOUS fence.
Without feedback from the device, the plan keeps what was copied since the last fence that
covered it (`_unfenced_*`).

Device order per step, which the runner keeps: (1) the load stream waits for the earlier
steps' stores, (2) early loads, (3) the store stream waits for the forward passes enqueued,
(4) stores, (5) the load stream waits for (4) and the forward passes, (6) late loads. Host
blocks are safe in this order: within one plan, every store takes its host block before any
load looks one up (stores come from booking and settling steps and from swap-ins, loads from
admissions, which come last), so a load never reads a host block a later store overwrites,
and a load of a host block written this step is late.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class CopyFence(enum.IntEnum):
    """How far a step's forward pass waits for the host tier's copies (module docstring)."""

    NONE = 0
    PREVIOUS = 1
    LOADS = 2
    ALL = 3


@dataclass(frozen=True)
class StepCopies:
    """One step's host-tier copies: early `loads` and `late_loads` (host block, GPU block),
    `stores` (GPU block, host block), and the fence its forward pass waits at."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    stores: list[tuple[int, int]] = field(default_factory=list)
    fence: CopyFence = CopyFence.NONE
    late_loads: list[tuple[int, int]] = field(default_factory=list)


class _Copied:
    """GPU blocks (or requests) touched by copies not yet known done: `earlier` steps', and
    this step's early and late ones."""

    def __init__(self) -> None:
        self.earlier: set[int | str] = set()
        self.early: set[int | str] = set()
        self.late: set[int | str] = set()

    def __bool__(self) -> bool:
        return bool(self.earlier or self.early or self.late)

    def carry(self, fence: CopyFence) -> None:
        """After a step: a fence clears what it waited for; the rest joins the earlier ones."""
        if fence >= CopyFence.PREVIOUS:
            self.earlier.clear()
        if fence >= CopyFence.LOADS:
            self.early.clear()
        if fence >= CopyFence.ALL:
            self.late.clear()
        self.earlier |= self.early | self.late
        self.early.clear()
        self.late.clear()


class CopyPlan:
    """Collects a step's copies and decides its fence (module docstring)."""

    def __init__(self) -> None:
        self._loads: list[tuple[int, int]] = []
        self._late_loads: list[tuple[int, int]] = []
        self._stores: list[tuple[int, int]] = []
        self._fence = CopyFence.NONE
        self._loaded = _Copied()  # GPU blocks loaded
        self._stored = _Copied()  # GPU blocks stored (a store is never "early": it goes in late)
        self._loading = _Copied()  # requests that read loaded blocks
        self._stored_host: set[int] = set()  # host blocks this step's stores write
        self._freed: set[int] = set()  # GPU blocks freed since the last step was planned

    def freed(self, gpu_ids: Iterable[int]) -> None:
        """These GPU blocks were released: the step in flight may still use them."""
        self._freed.update(gpu_ids)

    def load(self, host_id: int, gpu_id: int) -> None:
        if gpu_id in self._freed or gpu_id in self._stored.late or host_id in self._stored_host:
            self._late_loads.append((host_id, gpu_id))
            self._loaded.late.add(gpu_id)
        else:
            self._loads.append((host_id, gpu_id))
            self._loaded.early.add(gpu_id)

    def store(self, gpu_id: int, host_id: int) -> None:
        self._stores.append((gpu_id, host_id))
        self._stored.late.add(gpu_id)
        self._stored_host.add(host_id)

    def reads(self, request_id: str, gpu_ids: Iterable[int]) -> None:
        """`request_id` will read these blocks (its prefix): if a load fills any of them, it
        waits for that load (`is_loading_now`, `runs`)."""
        loaded = self._loaded
        if not loaded:
            return
        waits: set[int | str] | None = None
        for gpu_id in gpu_ids:
            if gpu_id in loaded.late:
                waits = self._loading.late
                break
            if gpu_id in loaded.early:
                waits = self._loading.early
            elif gpu_id in loaded.earlier and waits is None:
                waits = self._loading.earlier
        if waits is not None:
            waits.add(request_id)

    def is_loading_now(self, request_id: str) -> bool:
        """Whether `request_id` waits for this step's late loads (it may not run in this step)."""
        return request_id in self._loading.late

    def runs(self, request_id: str) -> None:
        """`request_id` runs in this step: if it waits for loads, the step fences."""
        loading = self._loading
        if not loading:
            return
        assert request_id not in loading.late, f"{request_id} runs before its loads"
        if request_id in loading.early:
            self._raise(CopyFence.LOADS)
        elif request_id in loading.earlier:
            self._raise(CopyFence.PREVIOUS)

    def allocated(self, gpu_ids: Iterable[int]) -> None:
        """These GPU blocks take new data this step: fence any copy they may still be in."""
        loaded, stored = self._loaded, self._stored
        if not (loaded or stored):
            return
        for gpu_id in gpu_ids:
            if gpu_id in loaded.late or gpu_id in stored.late:
                self._raise(CopyFence.ALL)
                return
            if gpu_id in loaded.early:
                self._raise(CopyFence.LOADS)
            elif gpu_id in loaded.earlier or gpu_id in stored.earlier:
                self._raise(CopyFence.PREVIOUS)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: it waits for nothing any more."""
        self._loading.earlier.discard(request_id)
        self._loading.early.discard(request_id)
        self._loading.late.discard(request_id)

    def take(self) -> StepCopies:
        """The step's copies and fence; what they leave unfenced carries to the next step."""
        copies = StepCopies(self._loads, self._stores, self._fence, self._late_loads)
        for copied in (self._loaded, self._stored, self._loading):
            copied.carry(self._fence)
        self._loads, self._late_loads, self._stores = [], [], []
        self._fence = CopyFence.NONE
        self._stored_host.clear()
        self._freed.clear()
        return copies

    def _raise(self, fence: CopyFence) -> None:
        self._fence = max(self._fence, fence)
