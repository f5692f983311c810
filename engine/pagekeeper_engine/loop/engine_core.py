"""The engine core's serving loop: messages in, one step at a time, messages out.

Runs in its own process (see `engine_process`), so the step loop never shares an interpreter
lock with HTTP, tokenization or detokenization. Requests arrive from every front end on one
PULL socket; each step's outputs go, in one `StepOutputs` message per front end, to the front
end that sent the request (PUSH sockets with no high-water mark: a slow front end never stalls
a step). The loop's stats ride on those messages at most every `STATS_INTERVAL_S`; an idle
loop sends them every `HEARTBEAT_INTERVAL_S` as a heartbeat.

The loop ends on `Shutdown` (exit 0), when the process that started it is gone (exit 1: the
pod's front end died), or on a `FatalEngineError` (out-of-memory errors past the engine's limit,
any step failure under tensor parallelism, a tensor-parallel rank that died: `fail`, from any
thread): a `Fatal` message to every front end, `fatal` set, exit 1. `announce_fatal` sends the
same message from a thread of its own where the loop cannot get there. Each turn of the loop is
marked (`last_turn_s`, read with the requests held by `progress`) for the progress watchdog.

With KV cache events on, each turn's events go to the `kv_events` sink (a publisher thread:
the turn only queues them). `Draining` (a front end's SIGTERM) and `Shutdown` report every
cached block gone first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import zmq

from pagekeeper_engine.core.kv_events import KVEventSink
from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.faults import FatalEngineError
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import (
    HEARTBEAT_INTERVAL_S,
    STATS_INTERVAL_S,
    AbortRequests,
    AddRequest,
    AdminReply,
    AdminRequest,
    CoreAddresses,
    Draining,
    EngineOutput,
    Fatal,
    FromCore,
    LoopStats,
    Ready,
    Shutdown,
    StepOutputs,
    ToCore,
    from_core_codec,
    to_core_codec,
)
from pagekeeper_engine.progress_watch import LoopProgress

logger = logging.getLogger(__name__)

LINGER_MS = 2000  # how long closing sockets may take to deliver the last messages
PARENT_CHECK_INTERVAL_S = 0.5


def _rejected(request_id: str, reason: str, param: str | None = None) -> EngineOutput:
    return EngineOutput(
        request_id,
        [],
        True,
        "abort",
        0,
        0,
        0,
        error=reason,
        is_rejected=True,
        rejected_param=param,
    )


class EngineCore:
    """Serves one `LLMEngine` to `num_clients` front ends over ZMQ.

    `is_parent_alive` says whether the process that started this one still runs; when it
    stops, nothing is left to answer and the loop exits.
    """

    def __init__(
        self,
        engine: LLMEngine,
        addresses: CoreAddresses,
        num_clients: int,
        *,
        is_parent_alive: Callable[[], bool] = lambda: True,
        kv_events: KVEventSink | None = None,
    ) -> None:
        self.engine = engine
        self._kv_events = kv_events if engine.kv_events is not None else None
        self.fatal: FatalEngineError | None = None
        self._failure: FatalEngineError | None = None  # set by `fail`, from any thread
        self._is_parent_alive = is_parent_alive
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(addresses.inbox)
        self._outboxes = []
        for index in range(num_clients):
            outbox = self._context.socket(zmq.PUSH)
            outbox.setsockopt(zmq.SNDHWM, 0)
            outbox.setsockopt(zmq.LINGER, LINGER_MS)
            outbox.connect(addresses.outbox(index))
            self._outboxes.append(outbox)
        self._decode = to_core_codec().decode
        self._encode = from_core_codec().encode
        self._owners: dict[str, int] = {}  # request id -> the front end that sent it
        self._last_stats_s = 0.0
        self._last_parent_check_s = time.monotonic()
        self._is_stopping = False
        # time.monotonic() at the start of the newest turn; written by the loop, read by the
        # progress watchdog's thread (one float store a turn)
        self.last_turn_s = time.monotonic()

    @property
    def fatal_error(self) -> str | None:
        """Why the loop gave up (None: it did not)."""
        return None if self.fatal is None else str(self.fatal)

    def progress(self) -> LoopProgress:
        """The newest turn's mark and the requests held; safe from any thread (it only reads
        lengths)."""
        scheduler = self.engine.scheduler
        return LoopProgress(
            self.last_turn_s,
            len(scheduler.running),
            len(scheduler.waiting) + len(scheduler.swapped),
        )

    def send_ready(self, ready: Ready) -> None:
        self._broadcast(ready)

    def fail(self, error: FatalEngineError) -> None:
        """End the loop at its next turn as if a step had raised `error`; safe from any thread
        (an idle loop turns at least every `HEARTBEAT_INTERVAL_S`)."""
        self._failure = error

    def close(self) -> None:
        self._inbox.close(linger=0)
        for outbox in self._outboxes:
            outbox.close()
        self._context.term()

    def run(self) -> int:
        """Serve until told to stop; the process's exit code."""
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        engine = self.engine
        while not self._is_stopping:
            if engine.has_work() or poller.poll(int(HEARTBEAT_INTERVAL_S * 1000)):
                self._receive_all()
            if self._failure is not None:
                self._give_up(self._failure)
                return 1
            if self._is_stopping:
                break
            now = time.monotonic()
            self.last_turn_s = now
            if now - self._last_parent_check_s >= PARENT_CHECK_INTERVAL_S:
                self._last_parent_check_s = now
                if not self._is_parent_alive():
                    logger.error("the front end that started the engine core is gone; exiting")
                    return 1
            if not engine.has_work():
                self._publish_kv_events()
                engine.sample_memory()
                self._send_outputs([], force_stats=True)
                continue
            try:
                outputs = engine.step()
            except FatalEngineError as exc:
                self._give_up(exc)
                return 1
            except Exception:  # a scheduler bug: fail what is in flight, counted as a failure
                logger.exception("engine step raised; failing every request in flight")
                engine.count_failed_step()
                outputs = self._fail_all("the engine failed while stepping")
            self._publish_kv_events()
            # an engine that just went idle reports at once: counters match what was answered
            self._send_outputs(outputs, force_stats=not engine.has_work())
        self._send_outputs(self._fail_all("the engine core is shutting down"), force_stats=True)
        self._publish_kv_events()
        return 0

    def _publish_kv_events(self) -> None:
        log = self.engine.kv_events
        if self._kv_events is not None and log is not None and log.events:
            self._kv_events.publish(log.take())

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._decode(data)
            except ValueError:
                logger.exception("dropping a message of no known type (%d bytes)", len(data))
                continue
            self._apply(message)

    def _apply(self, message: ToCore) -> None:
        if isinstance(message, AddRequest):
            self._owners[message.request_id] = message.client_index
            try:
                self.engine.add_request(
                    message.request_id, message.prompt_token_ids, message.params
                )
            except RequestRejectedError as exc:
                self._owners.pop(message.request_id)
                rejected = _rejected(message.request_id, str(exc), exc.param)
                self._send(message.client_index, StepOutputs([rejected]))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.engine.abort(request_id, message.reason)
        elif isinstance(message, AdminRequest):
            self._send(message.client_index, self._admin(message))
        elif isinstance(message, Draining):
            self.engine.begin_shutdown()
        elif isinstance(message, Shutdown):
            logger.info("shutdown requested")
            self.engine.begin_shutdown()
            self._is_stopping = True

    def _admin(self, request: AdminRequest) -> AdminReply:
        if not self.engine.has_allocator:
            return AdminReply(request.call_id, error="this device has no caching allocator")
        try:
            return AdminReply(request.call_id, self.engine.defragment(request.max_running))
        except Exception as exc:  # reported to the caller, which answers 500
            logger.exception("defragment failed")
            return AdminReply(request.call_id, error=f"{type(exc).__name__}: {exc}")

    def _send_outputs(self, outputs: list[EngineOutput], *, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats: LoopStats | None = None
        if force_stats or now - self._last_stats_s >= STATS_INTERVAL_S:
            stats = self.engine.stats()
            if self._kv_events is not None:
                stats = replace(
                    stats,
                    num_kv_events_published=self._kv_events.num_published,
                    num_kv_events_dropped=self._kv_events.num_dropped,
                )
            self._last_stats_s = now
        if len(self._outboxes) == 1:
            for output in outputs:
                if output.finished:
                    self._owners.pop(output.request_id, None)
            if outputs or stats is not None:
                self._send(0, StepOutputs(outputs, stats))
            return
        by_client: list[list[EngineOutput]] = [[] for _ in self._outboxes]
        for output in outputs:
            owner = (
                self._owners.pop(output.request_id, None)
                if output.finished
                else self._owners.get(output.request_id)
            )
            if owner is not None:
                by_client[owner].append(output)
        for index, client_outputs in enumerate(by_client):
            if client_outputs or stats is not None:
                self._send(index, StepOutputs(client_outputs, stats))

    def _fail_all(self, reason: str) -> list[EngineOutput]:
        """Abort every request in flight, each with an output carrying `reason`."""
        outputs = []
        for request_id in list(self.engine.scheduler.requests):
            try:
                self.engine.abort(request_id)
            except Exception:  # state may be what broke; the request is failed regardless
                logger.exception("could not abort %s", request_id)
            outputs.append(EngineOutput(request_id, [], True, "abort", 0, 0, 0, error=reason))
        return outputs

    def _give_up(self, error: FatalEngineError) -> None:
        logger.critical("giving up: %s", error)
        self.fatal = error
        self._broadcast(Fatal(str(error)))

    def _broadcast(self, message: FromCore) -> None:
        for index in range(len(self._outboxes)):
            self._send(index, message)

    def _send(self, client_index: int, message: FromCore) -> None:
        self._outboxes[client_index].send(self._encode(message), copy=False)


def announce_fatal(addresses: CoreAddresses, num_clients: int, reason: str) -> None:
    """Send `Fatal(reason)` to every front end over sockets of this call's own, so any thread
    may, whatever the loop's sockets are doing."""
    context = zmq.Context()
    data = from_core_codec().encode(Fatal(reason))
    try:
        for index in range(num_clients):
            outbox = context.socket(zmq.PUSH)
            outbox.setsockopt(zmq.LINGER, LINGER_MS)
            outbox.connect(addresses.outbox(index))
            outbox.send(data, zmq.NOBLOCK)
            outbox.close()
    except zmq.ZMQError as exc:  # the front end is gone too; its process watch ends it
        logger.warning("could not tell the front ends: %s", exc)
    finally:
        context.term()
