"""`CoreClient`: the `EngineClient` of a front end, talking to the engine core over ZMQ.

One task receives the core's messages. A `StepOutputs` message is turned into text for every
request in it with one tokenizer call (`detokenizer`); a stop string ends the request here and
tells the core to stop it. Each request's outputs wait in a list until its consumer takes them
all at once, so a consumer that falls behind by several steps writes one merged output, not
one per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.client import (
    EngineDeadError,
    EngineDrainingError,
    RequestFailedError,
    RequestOutput,
)
from pagekeeper_engine.frontend.detokenizer import (
    DecodeBatch,
    TextState,
    cut_at_stop_string,
    detokenize_next,
    take_new_text,
)
from pagekeeper_engine.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    AdminReply,
    AdminRequest,
    CoreAddresses,
    DefragmentResult,
    Draining,
    EngineOutput,
    Fatal,
    LoopStats,
    Ready,
    Shutdown,
    StepOutputs,
    ToCore,
    from_core_codec,
    to_core_codec,
)

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 30.0  # a step in flight finishes well within this


@dataclass
class _Request:
    text: TextState
    items: list[RequestOutput | BaseException] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    is_done: bool = False  # its last output or error is queued

    def put(self, item: RequestOutput | BaseException, *, is_last: bool) -> None:
        self.items.append(item)
        self.is_done = is_last
        self.wakeup.set()


class CoreClient:
    """Front end `client_index`'s connection to the engine core at `addresses`.

    `is_core_running` says whether the core's process runs (where this process can tell);
    `heartbeat_timeout_s` bounds how long the core may stay silent before /health fails.
    """

    def __init__(
        self,
        addresses: CoreAddresses,
        client_index: int,
        decode_batch: DecodeBatch,
        *,
        is_core_running: Callable[[], bool] = lambda: True,
        heartbeat_timeout_s: float = 60.0,
        max_consecutive_failed_steps: int = 3,
    ) -> None:
        self.client_index = client_index
        self._decode_batch = decode_batch
        self._is_core_running = is_core_running
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.setsockopt(zmq.LINGER, 1000)
        self._to_core.connect(addresses.inbox)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(addresses.outbox(client_index))
        self._encode = to_core_codec().encode
        self._decode = from_core_codec().decode
        self._requests: dict[str, _Request] = {}
        self._admin: dict[int, asyncio.Future[AdminReply]] = {}
        self._call_ids = itertools.count()
        self._ready: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        self._stats: LoopStats | None = None
        self._last_heard_s = time.monotonic()
        self._idle = asyncio.Event()
        self._idle.set()
        self._is_draining = False
        self.dead_reason: str | None = None
        self.died = asyncio.Event()  # set when the core is gone or gave up
        self._receiver = asyncio.create_task(self._receive(), name="core-receiver")

    # -- state ------------------------------------------------------------------------------

    @property
    def ready(self) -> Ready:
        assert self._ready.done(), "the engine core has not sent its handshake yet"
        return self._ready.result()

    async def wait_ready(self) -> Ready:
        """The core's handshake; raises EngineDeadError if it failed first."""
        return await self._ready

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def is_alive(self) -> bool:
        stats = self._stats
        return (
            self.dead_reason is None
            and self._ready.done()
            and self._is_core_running()
            and time.monotonic() - self._last_heard_s < self.heartbeat_timeout_s
            and (
                stats is None
                or stats.num_consecutive_failed_steps < self.max_consecutive_failed_steps
            )
        )

    def stats(self) -> LoopStats | None:
        return self._stats

    def on_core_death(self, reason: str) -> None:
        """The core is gone: fail every request in flight and every call waiting on it."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._is_draining = True
        self.died.set()
        error = EngineDeadError(reason)
        if not self._ready.done():
            self._ready.set_exception(error)
        for request in self._requests.values():
            if not request.is_done:
                request.put(error, is_last=True)
        for future in self._admin.values():
            if not future.done():
                future.set_exception(error)

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput]:
        if self._is_draining:
            raise EngineDrainingError("the engine is shutting down and accepts no new requests")
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine core is not running")
        if request_id in self._requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in flight")
        request = _Request(TextState.for_prompt(prompt_token_ids, params))
        self._requests[request_id] = request
        self._idle.clear()
        self._send(AddRequest(request_id, prompt_token_ids, params, self.client_index))
        is_finished = False
        try:
            while not is_finished:
                await request.wakeup.wait()
                request.wakeup.clear()
                items, request.items = request.items, []
                for item in items:
                    if isinstance(item, BaseException):
                        is_finished = True
                        raise item
                merged = RequestOutput.merged(items)  # type: ignore[arg-type]
                is_finished = merged.finished
                yield merged
        finally:
            del self._requests[request_id]
            if not self._requests:
                self._idle.set()
            if not request.is_done:
                self._send(AbortRequests([request_id]))

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.is_done:
            return
        self._send(AbortRequests([request_id]))

    async def defragment(self, max_running: int) -> DefragmentResult:
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine core is not running")
        call_id = next(self._call_ids)
        future: asyncio.Future[AdminReply] = asyncio.get_running_loop().create_future()
        self._admin[call_id] = future
        try:
            self._send(AdminRequest(call_id, self.client_index, max_running))
            reply = await asyncio.wait_for(future, ADMIN_TIMEOUT_S)
        finally:
            self._admin.pop(call_id, None)
        if reply.error is not None or reply.result is None:
            raise RuntimeError(reply.error or "the engine core sent no result")
        return reply.result

    async def drain(self, timeout: float) -> bool:
        self._is_draining = True
        self._send(Draining())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        leftover = [rid for rid, request in self._requests.items() if not request.is_done]
        if leftover:
            self._send(AbortRequests(leftover))
            logger.warning(
                "drain timed out after %.1f s; aborted %d requests", timeout, len(leftover)
            )
        return not leftover

    def shutdown_core(self) -> None:
        """Tell the core to stop (it aborts what is still in flight and exits 0)."""
        self._send(Shutdown())

    async def close(self) -> None:
        self._receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._receiver
        self._from_core.close(linger=0)
        self._to_core.close()
        self._context.term()

    # -- the core's messages ----------------------------------------------------------------

    def _send(self, message: ToCore) -> None:
        # No high-water mark: a send never waits, so it needs no await.
        self._to_core.send(self._encode(message), flags=zmq.NOBLOCK, copy=False)

    async def _receive(self) -> None:
        while True:
            data = await self._from_core.recv()
            self._last_heard_s = time.monotonic()
            try:
                message = self._decode(data)
            except ValueError:
                logger.exception("dropping a message of no known type (%d bytes)", len(data))
                continue
            if isinstance(message, StepOutputs):
                if message.stats is not None:
                    self._stats = message.stats
                if message.outputs:
                    self._on_outputs(message.outputs)
            elif isinstance(message, Ready):
                self._on_ready(message)
            elif isinstance(message, AdminReply):
                future = self._admin.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, Fatal):
                logger.critical("the engine core gave up: %s", message.reason)
                self.on_core_death(f"the engine core gave up: {message.reason}")

    def _on_ready(self, ready: Ready) -> None:
        if self._ready.done():
            return
        if ready.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"the engine core speaks protocol {ready.protocol_version}, this front end "
                f"{PROTOCOL_VERSION}"
            )
            self.on_core_death(reason)
            return
        self._stats = ready.stats
        self._ready.set_result(ready)

    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        """Text for every request of one step (one tokenizer call), then hand each its output."""
        live: list[tuple[_Request, EngineOutput]] = []
        decoded: list[TextState] = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None or request.is_done:
                continue  # its consumer left, or a stop string already ended it
            if out.is_rejected:
                request.put(
                    RequestRejectedError(out.error or "rejected", out.rejected_param), is_last=True
                )
                continue
            if out.error is not None:
                request.put(RequestFailedError(out.error), is_last=True)
                continue
            # a stop token ends the text without showing up in it
            shown = out.new_token_ids
            if out.finished and out.finish_reason == "stop":
                shown = shown[:-1]
            if shown:
                request.text.append(shown)
                decoded.append(request.text)
            live.append((request, out))
        old_lengths = dict(
            zip(map(id, decoded), detokenize_next(self._decode_batch, decoded), strict=True)
        )
        stopped: list[str] = []
        for request, out in live:
            finished, reason = out.finished, out.finish_reason
            num_old_chars = old_lengths.get(id(request.text))
            if num_old_chars is not None and cut_at_stop_string(request.text, num_old_chars):
                if not finished:
                    stopped.append(out.request_id)
                finished, reason = True, "stop"
            output = RequestOutput(
                request_id=out.request_id,
                new_token_ids=out.new_token_ids,
                new_text=take_new_text(request.text, is_finished=finished),
                finished=finished,
                finish_reason=reason,
                num_prompt_tokens=out.num_prompt_tokens,
                num_output_tokens=out.num_output_tokens,
                num_cached_tokens=out.num_cached_tokens,
                logprobs=out.logprobs,
                top_logprobs=out.top_logprobs,
            )
            request.put(output, is_last=finished)
        if stopped:
            self._send(AbortRequests(stopped, "stop"))
