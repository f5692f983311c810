"""The rank watchdog over real processes: a worker that reports and exits, one that is killed,
one that shares rank 0's refusal, and workers told to stop; each reported once, or not at all."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest

from pagekeeper_engine.executor.protocol import EXIT_SHARED_REFUSAL, send_report
from pagekeeper_engine.executor.watchdog import RankWatchdog
from pagekeeper_engine.faults import RankFailedError

WAIT_S = 60.0  # spawning a process on a busy 2-core machine


def report_and_exit(reports: Connection, code: int) -> None:
    if code == 1:
        send_report(reports, "rank 1: a step failed", wrote_termination_message=True)
    sys.exit(code)


def wait_to_be_stopped(reports: Connection) -> None:
    threading.Event().wait()


class Ranks:
    """Workers 1..N as spawned processes, with the pipes their reports come on."""

    def __init__(self, *targets: tuple[object, tuple[object, ...]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.reports: list[Connection] = []
        for target, args in targets:
            reports, sender = context.Pipe(duplex=False)
            process = context.Process(target=target, args=(sender, *args), daemon=True)
            process.start()
            sender.close()
            self.processes.append(process)
            self.reports.append(reports)
        self.failures: list[RankFailedError] = []

    def on_failure(self, failure: RankFailedError) -> None:
        self.failures.append(failure)

    def watch(self) -> RankWatchdog:
        return RankWatchdog(self.processes, self.reports, self.on_failure)

    def end(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(WAIT_S)


@pytest.fixture
def ranks() -> list[Ranks]:
    made: list[Ranks] = []
    yield made  # type: ignore[misc]
    for each in made:
        each.end()


def test_a_worker_that_reports_and_exits_is_named_and_the_others_are_killed(
    ranks: list[Ranks],
) -> None:
    r = Ranks((wait_to_be_stopped, ()), (report_and_exit, (1,)))
    ranks.append(r)
    watchdog = r.watch()
    failure = watchdog.failure(WAIT_S)
    assert failure is not None
    pid = r.processes[1].pid
    assert str(failure) == f"tensor-parallel rank 2 (pid {pid}) exited (1): rank 1: a step failed"
    assert failure.wrote_termination_message
    watchdog.thread.join(WAIT_S)  # every worker has ended: the watchdog killed the other one
    r.processes[0].join(WAIT_S)  # reap it
    assert r.processes[0].exitcode == -signal.SIGKILL
    assert r.failures == [failure]  # reported once, though two ranks ended


def test_a_killed_worker_is_named_by_its_signal(ranks: list[Ranks]) -> None:
    r = Ranks((wait_to_be_stopped, ()))
    ranks.append(r)
    watchdog = r.watch()
    pid = r.processes[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    failure = watchdog.failure(WAIT_S)
    assert failure is not None
    assert str(failure) == f"tensor-parallel rank 1 (pid {pid}) was killed by signal 9"
    assert not failure.wrote_termination_message
    watchdog.thread.join(WAIT_S)  # the callback has returned
    assert r.failures == [failure]


def test_a_shared_refusal_is_not_reported(ranks: list[Ranks]) -> None:
    r = Ranks((report_and_exit, (EXIT_SHARED_REFUSAL,)))
    ranks.append(r)
    watchdog = r.watch()
    watchdog.thread.join(WAIT_S)
    assert not watchdog.thread.is_alive()
    assert r.processes[0].exitcode == EXIT_SHARED_REFUSAL
    assert r.failures == [] and watchdog.failure(0) is None  # rank 0 refuses it itself


def test_workers_told_to_stop_are_not_reported(ranks: list[Ranks]) -> None:
    r = Ranks((wait_to_be_stopped, ()), (wait_to_be_stopped, ()))
    ranks.append(r)
    watchdog = r.watch()
    watchdog.stop()
    for process in r.processes:
        process.kill()
    watchdog.thread.join(WAIT_S)
    assert not watchdog.thread.is_alive()
    assert r.failures == [] and watchdog.failure(0) is None
