"""The rank watchdog: notices a worker rank that ends unasked and reports it to rank 0's owner.

It watches the workers' processes (`process_watch`), and on the first that ends while nobody
asked it to, reads the reason the rank sent before it exited (`protocol.RankReport`; none when
it was killed), kills the other workers and calls `on_failure` with a `RankFailedError`, on its
own thread. It does not end the process: the engine core's process decides that (a collective
with a dead peer would otherwise wait for the group's timeout). A worker that refused the same
start-up budget as rank 0 (`EXIT_SHARED_REFUSAL`) is not reported: rank 0 refuses it itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from pagekeeper_engine.executor.protocol import EXIT_SHARED_REFUSAL, read_report
from pagekeeper_engine.faults import RankFailedError
from pagekeeper_engine.process_watch import exit_code, watch_processes

logger = logging.getLogger(__name__)


class RankWatchdog:
    """Watches ranks 1..N-1 (`processes[r - 1]`, each with the pipe its report comes on)."""

    def __init__(
        self,
        processes: Sequence[BaseProcess],
        reports: Sequence[Connection],
        on_failure: Callable[[RankFailedError], None],
    ) -> None:
        self._processes = list(processes)
        self._reports = list(reports)
        self._on_failure = on_failure
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self._failure: RankFailedError | None = None
        # ends once every worker has ended
        self.thread = watch_processes(self._processes, self._on_exit, name="tp-watchdog")

    def stop(self) -> None:
        """The workers are being stopped: their exits from now on are asked for."""
        self._stopping.set()

    def failure(self, timeout_s: float) -> RankFailedError | None:
        """The first worker that ended unasked, waiting up to `timeout_s` for one (rank 0's
        step fails the moment a peer's connection drops, a moment before its exit is seen)."""
        self._failed.wait(timeout_s)
        return self._failure

    def _on_exit(self, process: BaseProcess) -> None:
        if self._stopping.is_set() or self._failed.is_set():
            return
        failure = self._describe_exit(self._processes.index(process) + 1)
        if failure is None:
            return
        logger.critical("%s; the engine cannot run without it and exits", failure)
        for other in self._processes:
            if other.is_alive():
                other.kill()
        self._failure = failure
        self._failed.set()
        self._on_failure(failure)

    def _describe_exit(self, rank: int) -> RankFailedError | None:
        """Worker `rank`'s unasked exit as the engine's failure (None: nothing to report)."""
        process = self._processes[rank - 1]
        code = exit_code(process)
        if code == EXIT_SHARED_REFUSAL:
            return None  # rank 0 refuses the same budget and says why
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
        report = read_report(self._reports[rank - 1])
        what = f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
        if report is None:
            return RankFailedError(what)
        return RankFailedError(
            f"{what}: {report.reason}", wrote_termination_message=report.wrote_termination_message
        )
