"""The asyncio face of the step loop: one background thread steps, coroutines await outputs.

The model is not thread-safe, so exactly one thread touches the `LLMEngine`. Requests reach it
through a thread-safe command queue; its outputs reach each request's `asyncio.Queue` through
`loop.call_soon_threadsafe`.

The step thread holds the GIL for long stretches of Python (scheduling, packing a batch,
detokenizing). At CPython's default switch interval of 5 ms, the HTTP thread waits up to that
long at every GIL hand-over, several times per request, so /health and token streams stall
behind a busy engine. `start` shortens the interval (process-wide: the engine thread is what
makes it necessary) and the loop yields the GIL after every step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.outputs import RequestOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.engine import LLMEngine
from pagekeeper_engine.loop_stats import DefragmentResult, LoopStats
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how often an idle loop wakes to heartbeat
SWITCH_INTERVAL_S = 0.0005  # GIL switch interval while the step thread runs (CPython: 0.005)
_DRAIN_POLL_S = 0.05


class EngineDrainingError(RuntimeError):
    """The engine is draining or stopped and takes no new requests (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The step loop is not running (the server answers 503; /health fails)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (the server answers 500)."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `fn` on the loop thread between steps; its result completes `future`."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


_Command = _Add | _Abort | _Call | None  # None only wakes the loop


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLMEngine:
    """Serves `LLMEngine` to asyncio code: `generate` streams a request's outputs.

    Cancelling the task that consumes `generate` (a client that disconnects) aborts the request
    and frees its blocks. `drain` stops admission and waits for requests in flight; `is_alive`
    is what /health reports: the loop thread runs, has heartbeated within `heartbeat_timeout_s`
    and its runner is not failing step after step.

    When out-of-memory errors repeat past the engine's limit, the loop stops, fails every
    request in flight, records `fatal_error` and calls `on_fatal` (from the loop thread): the
    process must exit so that the pod restarts (see `cli`).
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        heartbeat_timeout_s: float = 60.0,
        max_consecutive_failed_steps: int = 3,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self._stats = engine.stats()
        self._is_draining = False

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def start(self, switch_interval_s: float | None = SWITCH_INTERVAL_S) -> None:
        """Start the step thread; `switch_interval_s` (None: leave it) sets the interpreter's
        GIL switch interval."""
        if self._thread is not None:
            return
        if switch_interval_s is not None:
            sys.setswitchinterval(switch_interval_s)
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        thread = self._thread
        return (
            thread is not None
            and thread.is_alive()
            and time.monotonic() - self._heartbeat < self.heartbeat_timeout_s
            and self.engine.num_consecutive_failed_steps < self.max_consecutive_failed_steps
        )

    def stats(self) -> LoopStats:
        """The snapshot the loop published after its latest step."""
        return self._stats

    @property
    def has_allocator(self) -> bool:
        return self.engine.has_allocator

    async def defragment(self, max_running: int) -> DefragmentResult:
        """Release the allocator's cached segments on the loop thread, between steps, if at
        most `max_running` sequences are running (else a result with `is_done` False)."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[DefragmentResult] = loop.create_future()
        self._commands.put(_Call(lambda: self.engine.defragment(max_running), loop, future))
        return await future

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until one is `finished`.

        Raises (at the first iteration) RequestRejectedError for a request that can never run,
        EngineDrainingError / EngineDeadError when nothing new is accepted, and
        RequestFailedError when the engine fails while running it.
        """
        if self._is_draining or self._stop.is_set():
            raise EngineDrainingError("the engine is shutting down and accepts no new requests")
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self.engine.check_request(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise RequestRejectedError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, list(prompt_token_ids), params))
        is_done = False
        try:
            while not is_done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                if item.error is not None:
                    is_done = True
                    raise RequestFailedError(item.error)
                is_done = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not is_done:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """End a request; its consumer gets a final output with finish_reason "abort"."""
        self._commands.put(_Abort(request_id))

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` s for those in flight; abort the rest.

        True when every request finished on its own.
        """
        self._is_draining = True
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        with self._lock:
            leftover = list(self._streams)
        for request_id in leftover:
            self.abort(request_id)
        if leftover:
            logger.warning(
                "drain timed out after %.1f s; aborted %d requests", timeout, len(leftover)
            )
        return not leftover

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still in flight fail with EngineDeadError."""
        self._is_draining = True
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine loop did not stop within %.1f s", timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                self._apply_commands(wait=not self.engine.has_work())
                if self._stop.is_set() or not self.engine.has_work():
                    continue
                try:
                    outputs = self.engine.step()
                except EngineOutOfMemoryError as exc:
                    self._give_up(str(exc))
                    return
                except Exception:  # a scheduler bug: fail what is in flight, keep serving
                    logger.exception("engine step raised; failing every request in flight")
                    self._fail_all(RequestFailedError("the engine failed while stepping"))
                    outputs = []
                self._stats = self.engine.stats()
                self._dispatch(outputs)
                time.sleep(0)  # let the HTTP thread take the GIL between steps
        except Exception:
            logger.exception("the engine loop crashed")
        finally:
            reason = "the engine loop stopped"
            if self.fatal_error is not None:
                reason += f": {self.fatal_error}"
            self._fail_all(EngineDeadError(reason))

    def _apply_commands(self, *, wait: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if wait else self._commands.get_nowait()
            )
        except queue.Empty:
            self.engine.sample_memory()
            self._stats = self.engine.stats()
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params
                )
            except RequestRejectedError as exc:
                self._send(command.request_id, exc)
        elif isinstance(command, _Abort):
            self.engine.abort(command.request_id)
        elif isinstance(command, _Call):
            _call(command)

    def _give_up(self, reason: str) -> None:
        logger.critical("giving up: %s", reason)
        self.fatal_error = reason
        self._is_draining = True
        self._stats = self.engine.stats()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # its consumer left; the abort it queued is on its way
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed
            logger.warning("dropping request %s: its event loop is closed", request_id)
            self.engine.abort(request_id)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._send(request_id, error)
        for request_id in list(self.engine.scheduler.requests):
            try:
                self.engine.abort(request_id)
            except Exception:  # state may be what broke; the requests are failed regardless
                logger.exception("could not abort %s", request_id)


def _call(command: _Call) -> None:
    def settle(ok: bool, value: Any) -> None:
        if command.future.done():  # its awaiter was cancelled
            return
        if ok:
            command.future.set_result(value)
        else:
            command.future.set_exception(value)

    try:
        result = command.fn()
    except Exception as exc:  # handed to the awaiting coroutine, which reports it
        command.loop.call_soon_threadsafe(settle, False, exc)
    else:
        command.loop.call_soon_threadsafe(settle, True, result)
