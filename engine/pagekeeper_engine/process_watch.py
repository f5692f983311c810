"""The engine's one way to notice that another of its processes ended.

A daemon thread waits on the processes' sentinels, which turn readable the moment a process
exits, however it ended (a signal, `os._exit`, a crash), so nothing polls. `on_exit` runs on
that thread, once per process, and decides what the exit means: the supervising front end reaps
and logs the core and the other front ends, the engine core's watchdog reports a dead
tensor-parallel rank, and the core, each worker rank and each other front end end with the
process that started them. `exit_code` reads how a process ended without reaping it, so a watch
never races the process's owner, whose `join` reaps it (multiprocessing's reaping is not safe
from two threads at once: the loser sees no exit code at all).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess


def watch_processes(
    processes: Sequence[BaseProcess], on_exit: Callable[[BaseProcess], None], *, name: str
) -> threading.Thread:
    """Call `on_exit(process)` on a daemon thread named `name` as each of `processes` ends."""
    pending = {process.sentinel: process for process in processes}

    def watch() -> None:
        while pending:
            for sentinel in wait(list(pending)):
                assert isinstance(sentinel, int)
                on_exit(pending.pop(sentinel))

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def watch_parent(on_exit: Callable[[], None]) -> None:
    """Call `on_exit()` on a daemon thread when the process that started this one ends."""
    parent = multiprocessing.parent_process()
    assert parent is not None, "only a process started through multiprocessing has a parent"
    watch_processes([parent], lambda _: on_exit(), name="parent-watch")


def exit_code(process: BaseProcess) -> int | None:
    """How an ended child process exited, as `exitcode` says it (negative: the signal that
    killed it), read without reaping it; None where it is not this process's child."""
    if process.pid is None:
        return None
    try:
        # blocks only for the moment between the sentinel turning readable and the exit itself
        status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped already (its `exitcode` knows) or not our child
        return process.exitcode
    if status is None:
        return process.exitcode
    return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
