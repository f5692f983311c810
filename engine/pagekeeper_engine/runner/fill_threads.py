"""How many threads a step's batch fill of grammar masks gets.

xgrammar starts the threads of a batch fill anew in every call, and each costs the fill more
than a cheap row's mask: on the 2-core CPU that runs CI, 64 rows of the structured benchmark's
schema filled in 0.34 ms median and 0.42 ms at p90 on one thread against 0.4-2.4 ms and 3.3-3.9
ms on two, and one thread was ahead at 16 and 256 rows too (docs/engine.md, structured output).
Threads pay only when the rows' work is large beside that cost: a costly grammar, many rows.

So a fill gets one thread per `THREAD_WORK_S` of the rows' work on one thread, estimated from
the fills that ran on one thread (an exponentially weighted mean of a row's seconds), at least
one and at most the cap. A fill on several threads says nothing reliable about a row's cost (its
time holds the threads' start), so every `PROBE_EVERY`th fill runs on one thread to keep the
estimate current. The first fill runs on one thread: it has no estimate yet.

No clock and no I/O here: the caller times its fills and reports them (`observe`). It runs
on one thread (the grammar thread), so nothing here is locked.
"""

from __future__ import annotations

import math

# One more thread per this much of a step's work on one thread.
THREAD_WORK_S = 2e-3
# Every this many fills, one runs on one thread to measure a row's cost again.
PROBE_EVERY = 128
# The newest one-thread fill's weight in the estimate of a row's seconds.
NEWEST_WEIGHT = 0.2


def threads_for(rows: int, row_seconds: float, max_threads: int) -> int:
    """Threads for `rows` rows at `row_seconds` each on one thread: one per `THREAD_WORK_S` of
    work, within 1..`max_threads`."""
    assert max_threads >= 1, f"{max_threads} threads at most"
    wanted = math.ceil(rows * row_seconds / THREAD_WORK_S)
    return max(1, min(max_threads, wanted))


class FillThreads:
    """The thread count of each batch fill, from the one-thread fills observed so far."""

    def __init__(self, max_threads: int) -> None:
        assert max_threads >= 1, f"{max_threads} threads at most"
        self.max_threads = max_threads
        self.row_seconds: float | None = None  # none until a one-thread fill is observed
        self._num_chosen = 0

    def choose(self, rows: int) -> int:
        """The threads for the next fill, of `rows` rows."""
        probe = self._num_chosen % PROBE_EVERY == 0
        self._num_chosen += 1
        if probe or self.row_seconds is None:
            return 1
        return threads_for(rows, self.row_seconds, self.max_threads)

    def observe(self, threads: int, rows: int, seconds: float) -> None:
        """A fill of `rows` rows took `seconds` on `threads` threads."""
        if threads != 1 or rows == 0:
            return
        newest = seconds / rows
        if self.row_seconds is None:
            self.row_seconds = newest
        else:
            self.row_seconds += NEWEST_WEIGHT * (newest - self.row_seconds)
