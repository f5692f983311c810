"""Which way each all-reduce size goes, from what every rank timed at start-up: pure functions.

Three ways sum a message over the ranks: NCCL (then the residual-add norm kernel), and the
one-shot launch (`kernels/peer_reduce.py`) pushing each rank's rows to its peers or pulling
theirs. Pushing waits for the peers once and pulling twice, so pushing wins the small messages;
its receiving regions hold only those. Pulling moves the large ones faster, and past a size
NCCL's ring wins. Every rank must take the same way for the same message (ranks that disagreed
would wait in different collectives forever), so the choice is made from every rank's timings,
each way at its slowest rank's, by a function of them alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

OneShotWay = Literal["push", "pull"]


@dataclass(frozen=True)
class AllReduceTiming:
    """One message size's time by each way, in microseconds: the sum over the ranks and the
    residual-add norm after it (NCCL, then the norm kernel; a one-shot way's one launch). A
    way that cannot take the size is at infinity."""

    num_bytes: int
    nccl_us: float
    push_us: float
    pull_us: float

    @property
    def one_shot_us(self) -> float:
        """The faster one-shot way's time."""
        return min(self.push_us, self.pull_us)


@dataclass(frozen=True)
class AllReduceChoice:
    """Which all-reduces run one-shot: those of at most `one_shot_max_bytes` (0: none), pushed
    up to `push_max_bytes` and pulled above; with the timings behind it, or the reason the
    one-shot path is off."""

    one_shot_max_bytes: int
    push_max_bytes: int = 0
    timings: tuple[AllReduceTiming, ...] = ()
    off_reason: str | None = None

    def way(self, num_bytes: int) -> OneShotWay | None:
        """How a message of `num_bytes` goes one-shot; None: through NCCL."""
        if num_bytes > self.one_shot_max_bytes:
            return None
        return "push" if num_bytes <= self.push_max_bytes else "pull"

    def describe(self) -> str:
        if self.off_reason is not None:
            return f"NCCL for every size ({self.off_reason})"
        timed = ", ".join(
            f"{t.num_bytes} B: {_us(t.push_us)} push / {_us(t.pull_us)} pull / "
            f"{_us(t.nccl_us)} NCCL"
            for t in self.timings
        )
        return (
            f"one-shot up to {self.one_shot_max_bytes} bytes, pushed up to "
            f"{self.push_max_bytes}, NCCL above (with the norm: {timed})"
        )


def _us(value: float) -> str:
    return f"{value:.1f} us" if math.isfinite(value) else "-"


def timed_rows(capacity_bytes: int, hidden_size: int, itemsize: int) -> list[int]:
    """The row counts timed at start-up: 1, 2, 4, ... and the most rows the buffer holds."""
    max_rows = capacity_bytes // (hidden_size * itemsize)
    rows = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
    if rows and rows[-1] != max_rows:
        rows.append(max_rows)
    return rows


def combine_rank_timings(per_rank: Sequence[Sequence[AllReduceTiming]]) -> list[AllReduceTiming]:
    """Every rank's timings (in rank order) -> one per size, each way at its slowest rank's
    time: a collective ends when its last rank does."""
    sizes = [t.num_bytes for t in per_rank[0]]
    assert all([t.num_bytes for t in timings] == sizes for timings in per_rank), (
        f"the ranks timed different sizes: {[[t.num_bytes for t in ts] for ts in per_rank]}"
    )
    return [
        AllReduceTiming(
            num_bytes=same_size[0].num_bytes,
            nccl_us=max(t.nccl_us for t in same_size),
            push_us=max(t.push_us for t in same_size),
            pull_us=max(t.pull_us for t in same_size),
        )
        for same_size in zip(*per_rank, strict=True)
    ]


def choose(timings: Sequence[AllReduceTiming]) -> AllReduceChoice:
    """From the smallest size up: one-shot for the leading run of sizes where its faster way
    is strictly faster than NCCL, and within that run, push for the leading sizes where it is
    strictly faster than pull. A win after a loss is taken for noise (the one-shot ways' costs
    grow with the bytes faster than NCCL's, and pushing's faster than pulling's), and two
    thresholds keep the choice two comparisons."""
    ordered = sorted(timings, key=lambda t: t.num_bytes)
    one_shot_max = push_max = 0
    pushing = True
    for timing in ordered:
        if timing.one_shot_us >= timing.nccl_us:
            break
        one_shot_max = timing.num_bytes
        pushing = pushing and timing.push_us < timing.pull_us
        if pushing:
            push_max = timing.num_bytes
    return AllReduceChoice(one_shot_max, push_max, tuple(ordered))
