"""What the HTTP server needs from the engine: the `EngineClient` protocol and its data.

The server imports this module, `messages` and the tokenizer, never the core's loop or the
runner: `core_client.CoreClient` implements the protocol over the process boundary, and tests
may pass any object that satisfies it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.messages import DefragmentResult, LoopStats, Ready


class EngineDrainingError(RuntimeError):
    """The engine is draining or stopped and takes no new requests (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine core is not running (the server answers 503; /health fails)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (the server answers 500)."""


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained since its previous output: token ids and text, and whether it
    ended.

    `new_text` never contains a stop string, nor text that could still turn out to begin one
    (held back until it cannot). `logprobs` has one entry per new token when the request asked
    for logprobs, else it is empty; `top_logprobs` likewise, one list of (token id,
    log-probability) alternatives per new token, when it asked for top alternatives.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @classmethod
    def merged(cls, outputs: list[RequestOutput]) -> RequestOutput:
        """One output for several consecutive ones of a request (a consumer that fell behind
        takes them at once): their tokens, text and log-probabilities in order, the last one's
        counts and ending."""
        if len(outputs) == 1:
            return outputs[0]
        last = outputs[-1]
        return cls(
            request_id=last.request_id,
            new_token_ids=[t for o in outputs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outputs),
            finished=last.finished,
            finish_reason=last.finish_reason,
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
            num_cached_tokens=last.num_cached_tokens,
            logprobs=[p for o in outputs for p in o.logprobs],
            top_logprobs=[t for o in outputs for t in o.top_logprobs],
        )


class EngineClient(Protocol):
    """The engine as the server sees it.

    `generate` streams one request's outputs (cancelling its consumer aborts the request and
    frees its blocks); `drain` stops admission and waits for requests in flight; `is_alive` is
    what /health reports, and `dead_reason` why it is not (None while the core runs, or where
    nothing said why).
    """

    dead_reason: str | None

    @property
    def ready(self) -> Ready:
        """The core's handshake: limits, KV-cache facts, the start-up memory budget."""
        ...

    @property
    def is_draining(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    def is_alive(self) -> bool: ...

    def stats(self) -> LoopStats | None:
        """The newest stats the core sent (None before the first)."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput]:
        """Raises (at the first iteration) RequestRejectedError for a request that can never
        run, EngineDrainingError / EngineDeadError when nothing new is accepted, and
        RequestFailedError when the engine fails while running it."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def defragment(self, max_running: int) -> DefragmentResult: ...

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait up to `timeout` s for those in flight, abort the rest;
        True when every request finished on its own."""
        ...
