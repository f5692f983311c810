"""One of the child's output pipes, read without blocking, so any thread may take what it holds.

The launcher's pumps wait for a pipe to become readable and then take its bytes under the
launcher's lock; the stop signal's handler takes what every pipe holds under the same lock
before it records where the drain begins. Without that, a memory error the child printed (and
survived) before the stop could still sit in a pipe, be read after the stop and be taken for a
drain that ran out of memory.

Bytes pass to the sink exactly as read; lines (split at `\\n` or `\\r`) are decoded as UTF-8
across reads, an invalid sequence replaced.
"""

from __future__ import annotations

import codecs
import os
import select
from collections.abc import Callable
from typing import IO

from pagekeeper_vllm.output import LineSplitter

READ_BYTES = 65536
# Reads a take makes at most, so a child that floods its pipe cannot hold the lock for long.
MAX_READS_PER_TAKE = 16


class ChildPipe:
    """The read end of one child pipe (set non-blocking here) and the sink its bytes go to."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self.source = source  # held: the file object closes the fd when it goes
        self.fd = source.fileno()
        os.set_blocking(self.fd, False)
        self.sink = sink
        self.is_closed = False  # the child's end is closed and every byte was taken
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._splitter = LineSplitter()
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    def wait_readable(self, timeout_s: float | None = None) -> bool:
        """Block until the pipe has bytes or its end closed (True), or `timeout_s` passed."""
        return bool(self._poller.poll(None if timeout_s is None else timeout_s * 1000))

    def take(self, on_line: Callable[[str], None]) -> bool:
        """Pass on what the pipe holds now (at most `MAX_READS_PER_TAKE` reads) and feed each
        complete line to `on_line`; False once the pipe is closed and drained (the last partial
        line fed too)."""
        if self.is_closed:
            return False
        for _ in range(MAX_READS_PER_TAKE):
            try:
                chunk = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                return True
            if not chunk:
                self._close(on_line)
                return False
            self.sink.write(chunk)
            self.sink.flush()
            for line in self._splitter.feed(self._decoder.decode(chunk)):
                on_line(line)
        return True

    def _close(self, on_line: Callable[[str], None]) -> None:
        self.is_closed = True
        for line in self._splitter.feed(self._decoder.decode(b"", final=True)):
            on_line(line)
        for line in self._splitter.flush():
            on_line(line)
