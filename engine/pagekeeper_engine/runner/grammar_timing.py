"""Where a structured step's grammar work spends the host's time, as histograms the step loop
reports (`core.stats.GrammarTimings`, exported as `pagekeeper_grammar_*_seconds`).

The grammar thread marks its job's moments (`FillTimes`, a few `time.perf_counter` reads); the
step loop's thread turns them into durations once it has the job's result, beside its own wait
and apply (`GrammarTimer.observe`). So every histogram is written by that one thread, the one
that also reads them for the stats, and a step without a schema costs nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from pagekeeper_engine.core.stats import STEP_SECONDS_BUCKETS, DurationCounts, GrammarTimings


@dataclass
class FillTimes:
    """`time.perf_counter` marks of one step's grammar work, in order. The launch sets
    `submitted`; the grammar thread the others, before its result is set (so the step loop
    reads them once `PendingMasks.filled` is done)."""

    submitted: float = 0.0  # handed to the grammar thread
    started: float = 0.0  # the grammar thread began it
    ids_on_host: float = 0.0  # the buffer's last copy read, the newest sampled ids on the host
    accepted: float = 0.0  # the matchers took their new tokens
    bitmask_seconds: float = 0.0  # inside xgrammar's batch fill
    bitmask_rows: int = 0  # the rows that batch fill filled (none: it did not run)
    ended: float = 0.0

    def parts(self) -> FillParts:
        """The durations between the marks."""
        fill_seconds = self.ended - self.started
        device_wait = self.ids_on_host - self.started
        accept = self.accepted - self.ids_on_host
        return FillParts(
            queue=self.started - self.submitted,
            fill=fill_seconds,
            device_wait=device_wait,
            accept=accept,
            bitmask=self.bitmask_seconds,
            host_ops=fill_seconds - device_wait - accept - self.bitmask_seconds,
        )


@dataclass(frozen=True)
class FillParts:
    """One step's grammar work in seconds: `queue` before the grammar thread starts it, then
    `fill`, the job, which its four parts sum to."""

    queue: float
    fill: float
    device_wait: float  # the buffer's last copy, then the newest ids on the host
    accept: float  # the matchers take their tokens
    bitmask: float  # xgrammar's batch fill
    host_ops: float  # the rest: the host bitmask's other rows, the check, Python


class DurationHistogram:
    """Counts of durations over `STEP_SECONDS_BUCKETS` (a bucket holds what is at most its
    bound), and their sum."""

    def __init__(self) -> None:
        self._counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)  # the last: above every bound
        self._sum_seconds = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self._sum_seconds += seconds

    def snapshot(self) -> DurationCounts:
        return DurationCounts(tuple(self._counts), self._sum_seconds)


class GrammarTimer:
    """The histograms of `GrammarTimings`, observed once per structured step."""

    def __init__(self) -> None:
        self.queue = DurationHistogram()
        self.fill = DurationHistogram()
        self.fill_device_wait = DurationHistogram()
        self.fill_accept = DurationHistogram()
        self.fill_bitmask = DurationHistogram()
        self.fill_host_ops = DurationHistogram()
        self.wait = DurationHistogram()
        self.apply = DurationHistogram()

    def observe(self, fill: FillTimes, wait_seconds: float, apply_seconds: float) -> None:
        """One step: its grammar job's marks, the step loop's wait for it and its apply."""
        parts = fill.parts()
        self.queue.observe(parts.queue)
        self.fill.observe(parts.fill)
        self.fill_device_wait.observe(parts.device_wait)
        self.fill_accept.observe(parts.accept)
        self.fill_bitmask.observe(parts.bitmask)
        self.fill_host_ops.observe(parts.host_ops)
        self.wait.observe(wait_seconds)
        self.apply.observe(apply_seconds)

    def snapshot(self) -> GrammarTimings:
        return GrammarTimings(
            queue=self.queue.snapshot(),
            fill=self.fill.snapshot(),
            fill_device_wait=self.fill_device_wait.snapshot(),
            fill_accept=self.fill_accept.snapshot(),
            fill_bitmask=self.fill_bitmask.snapshot(),
            fill_host_ops=self.fill_host_ops.snapshot(),
            wait=self.wait.snapshot(),
            apply=self.apply.snapshot(),
        )
