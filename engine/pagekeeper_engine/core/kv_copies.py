"""The copies between the GPU KV pool and the host tier that one step carries, and the fence
that keeps the step's forward pass from racing them.

Pure Python; never imports torch. The runner issues a step's copies on a side stream (loads
first, then stores), after the forward passes already enqueued and beside the step's own. A
copy touches its GPU block while it runs, so the forward pass must not write that block until
it is done. Instead of waiting for every copy, each step says how far its forward pass must
wait (`CopyFence`):
- NONE: it writes no block with a copy that may still be running, and reads no loaded block;
- PREVIOUS: it waits for the copies of earlier steps (a sequence whose blocks an earlier step
  loaded runs now; a block stored or loaded earlier is reused for new data);
- ALL: also for this step's own (a block stored this step is reused for new data at once).

A sequence whose loads a step issues does not run in that step: its load overlaps the step's
forward pass, and it runs in a later one behind a PREVIOUS fence. Without feedback from the
device, the plan keeps the blocks copied since the last fence (`_unfenced_*`): a fence clears
them, since every copy before it is then done.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

_T = TypeVar("_T")


class CopyFence(enum.IntEnum):
    """How far a step's forward pass waits for the host tier's copies (module docstring)."""

    NONE = 0
    PREVIOUS = 1
    ALL = 2


@dataclass(frozen=True)
class StepCopies:
    """One step's host-tier copies: `loads` (host block, GPU block) and `stores` (GPU block,
    host block), and the fence its forward pass waits at."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    stores: list[tuple[int, int]] = field(default_factory=list)
    fence: CopyFence = CopyFence.NONE


class CopyPlan:
    """Collects a step's copies and decides its fence (module docstring)."""

    def __init__(self) -> None:
        self._loads: list[tuple[int, int]] = []
        self._stores: list[tuple[int, int]] = []
        self._fence = CopyFence.NONE
        # GPU blocks copied since the last fence: [0] in earlier steps, [1] in this step
        self._loaded: tuple[set[int], set[int]] = (set(), set())
        self._stored: tuple[set[int], set[int]] = (set(), set())
        # requests that read loaded blocks, since the last fence: [0] earlier, [1] this step
        self._loading: tuple[set[str], set[str]] = (set(), set())

    def load(self, host_id: int, gpu_id: int) -> None:
        self._loads.append((host_id, gpu_id))
        self._loaded[1].add(gpu_id)

    def store(self, gpu_id: int, host_id: int) -> None:
        self._stores.append((gpu_id, host_id))
        self._stored[1].add(gpu_id)

    def reads(self, request_id: str, gpu_ids: Iterable[int]) -> None:
        """`request_id` will read these blocks (its prefix): if a load fills any of them, it
        waits for that load (`is_loading_now`, `runs`)."""
        earlier, now = self._loaded
        if not (earlier or now):
            return
        for gpu_id in gpu_ids:
            if gpu_id in now:
                self._loading[1].add(request_id)
                return
            if gpu_id in earlier:
                self._loading[0].add(request_id)

    def is_loading_now(self, request_id: str) -> bool:
        """Whether `request_id` waits for this step's loads (it may not run in this step)."""
        return request_id in self._loading[1]

    def runs(self, request_id: str) -> None:
        """`request_id` runs in this step: if it waits for earlier loads, the step fences."""
        earlier, now = self._loading
        if not (earlier or now):
            return
        assert request_id not in now, f"{request_id} runs before its loads"
        if request_id in earlier:
            self._raise(CopyFence.PREVIOUS)

    def allocated(self, gpu_ids: Iterable[int]) -> None:
        """These GPU blocks take new data this step: fence any copy they may still be in."""
        (loaded_before, loaded_now), (stored_before, stored_now) = self._loaded, self._stored
        if not (loaded_before or loaded_now or stored_before or stored_now):
            return
        for gpu_id in gpu_ids:
            if gpu_id in loaded_now or gpu_id in stored_now:
                self._raise(CopyFence.ALL)
                return
            if gpu_id in loaded_before or gpu_id in stored_before:
                self._raise(CopyFence.PREVIOUS)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: it waits for nothing any more."""
        self._loading[0].discard(request_id)
        self._loading[1].discard(request_id)

    def take(self) -> StepCopies:
        """The step's copies and fence; what they leave unfenced carries to the next step."""
        copies = StepCopies(self._loads, self._stores, self._fence)
        _carry(self._loaded, self._fence)
        _carry(self._stored, self._fence)
        _carry(self._loading, self._fence)
        self._loads, self._stores, self._fence = [], [], CopyFence.NONE
        return copies

    def _raise(self, fence: CopyFence) -> None:
        self._fence = max(self._fence, fence)


def _carry(sets: tuple[set[_T], set[_T]], fence: CopyFence) -> None:
    """After a step: a fence clears what it waited for; the rest of this step's joins the
    earlier ones."""
    earlier, now = sets
    if fence is not CopyFence.NONE:
        earlier.clear()
    if fence is CopyFence.ALL:
        now.clear()
    earlier |= now
    now.clear()
