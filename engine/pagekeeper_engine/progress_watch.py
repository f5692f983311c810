"""The step loop's progress watchdog: finds an engine core whose loop stopped turning.

The loop marks each turn with one monotonic time stamp (`EngineCore.last_turn_s`): a turn is a
step, or an idle wait of at most `HEARTBEAT_INTERVAL_S`, so a loop that serves, busy or idle,
never goes `--stuck-timeout` seconds without one. A loop that does is inside something that
does not return: a CUDA call on a wedged device, a collective whose peer rank hangs (under
tensor parallelism rank 0's loop stalls whichever rank hangs), a deadlock. The watchdog runs
on a daemon thread of its own, outside the thread that hangs, and costs the loop nothing: it
sleeps until the moment the newest mark would be too old and looks again only then, so it
wakes about once per timeout while the loop turns. A stuck loop is reported once, to
`on_stuck` on the watchdog's thread (`engine_process.StuckLoopHandler` ends the process).

It relies on the hung call releasing the interpreter lock, as torch's CUDA waits, its
collectives' waits and `threading` waits do; the front end's own bound on a silent core
(`CoreClient.heartbeat_timeout_s`) fails /health where one would not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagekeeper_engine.stuck import StuckReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopProgress:
    """What the watchdog reads off the loop: its newest mark and the requests it holds."""

    last_turn_s: float  # time.monotonic() at the start of the loop's newest turn
    num_running: int
    num_waiting: int  # waiting to start, and swapped out waiting to come back


def find_stuck(
    progress: LoopProgress, now_s: float, timeout_s: float, *, since_s: float = 0.0
) -> StuckReport | None:
    """The report of a loop whose newest turn began `timeout_s` or more before `now_s`; time
    before `since_s` (when watching began) never counts."""
    age_s = now_s - max(progress.last_turn_s, since_s)
    if age_s < timeout_s:
        return None
    held = f"{progress.num_running} running and {progress.num_waiting} waiting"
    return StuckReport(
        age_s,
        progress.num_running,
        progress.num_waiting,
        f"the engine's step loop completed no step for {age_s:.1f} s with {held} "
        f"(--stuck-timeout {timeout_s:g})",
    )


class ProgressWatchdog:
    """Watches `read()` on a daemon thread from now until `stop()`; `on_stuck` at most once.
    Time before the watchdog started never counts: that was start-up."""

    def __init__(
        self,
        timeout_s: float,
        read: Callable[[], LoopProgress],
        on_stuck: Callable[[StuckReport], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert timeout_s > 0, f"--stuck-timeout {timeout_s}: 0 means no watchdog at all"
        self._timeout_s = timeout_s
        self._read = read
        self._on_stuck = on_stuck
        self._clock = clock
        self._stopped = threading.Event()
        self._started_s = clock()
        self.thread = threading.Thread(target=self._watch, name="progress-watch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """The loop has ended on its own: nothing more to watch."""
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            progress = self._read()
            report = find_stuck(progress, self._clock(), self._timeout_s, since_s=self._started_s)
            if report is None:
                # asleep until the newest mark would be too old, unless the loop ends first
                newest_s = max(progress.last_turn_s, self._started_s)
                self._stopped.wait(newest_s + self._timeout_s - self._clock())
                continue
            if self._stopped.is_set():  # the loop ended while this one looked
                return
            self._on_stuck(report)
            return
