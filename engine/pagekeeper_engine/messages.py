"""The messages between the front ends and the engine core: the one boundary of the processes.

Front ends (HTTP, tokenization, detokenization, stop strings, SSE) and the engine core
(scheduler, KV manager, runner, step loop) run in separate processes and exchange only the
types below, encoded as MessagePack by `Codec` into typed structs (decoding never builds an
object of a type not named here: no pickle). Each message carries its type as a tag;
`PROTOCOL_VERSION` is in the `Ready` handshake and a front end refuses a core of another one.

Front end -> core: `AddRequest`, `AbortRequests`, `AdminRequest`, `Draining`, `Shutdown`.
Core -> front end: `Ready` (once, after the model is loaded), `StepOutputs` (one per step per
front end with work in it, with the loop's stats at most every `STATS_INTERVAL_S` and while
idle as a heartbeat), `AdminReply`, `Fatal` (the core is giving up and will exit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import msgspec

from pagekeeper_engine.core.limits import EngineLimits
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.stats import EngineStats
from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.memory.oom import OOM_EVENT_KINDS

PROTOCOL_VERSION = 6
STATS_INTERVAL_S = 0.1  # the loop's stats ride on step outputs at most this often
HEARTBEAT_INTERVAL_S = 0.5  # an idle core sends its stats this often


@dataclass(frozen=True)
class LoopStats(EngineStats):
    """`EngineStats` plus what the step loop knows of memory: out-of-memory events by kind,
    the live step token budget, and the newest allocator reading (None on the CPU)."""

    num_oom_events: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(OOM_EVENT_KINDS, 0))
    )
    step_token_budget: int = 0
    max_step_token_budget: int = 0
    allocator: AllocatorStats | None = None
    num_consecutive_failed_steps: int = 0
    # KV cache events sent to subscribers, and dropped before the wire (`kv_publisher`)
    num_kv_events_published: int = 0
    num_kv_events_dropped: int = 0


@dataclass(frozen=True)
class DefragmentResult:
    """What `/admin/defragment` reports. `is_done` False: too busy (nothing was released)."""

    is_done: bool
    num_running: int
    bytes_freed: int = 0
    before: AllocatorStats | None = None
    after: AllocatorStats | None = None
    seconds: float = 0.0


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request: its new token ids and where it stands.

    `error` is set when the request failed inside the core (finish_reason is then "abort");
    `is_rejected` when the core refused it before it ran (the front end answers 400).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[float | None] = []
    error: str | None = None
    is_rejected: bool = False
    rejected_param: str | None = None  # the field at fault in a rejected request
    # per new token where the request asked for alternatives: (token id, log-probability),
    # likeliest first
    top_logprobs: list[list[tuple[int, float]]] = []


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    client_index: int


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """End these requests. `reason` "stop": a stop string matched in the front end."""

    request_ids: list[str]
    reason: Literal["abort", "stop"] = "abort"


class AdminRequest(msgspec.Struct, tag=True, array_like=True):
    """Release the caching allocator's unused segments if at most `max_running` run."""

    call_id: int
    client_index: int
    max_running: int


class Draining(msgspec.Struct, tag=True, array_like=True):
    """A front end began its drain (SIGTERM): the core keeps running what it has, and tells
    KV-aware routers that its cached blocks are gone."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop the loop and exit 0 (requests still in flight are aborted)."""


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The loaded core's facts, worked out once and handed to every front end."""

    protocol_version: int
    limits: EngineLimits
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    kv_cache_dtype: str
    memory_budget_bytes: list[dict[str, int]] | None  # each rank's start-up budget terms
    has_allocator: bool
    is_async_scheduling: bool
    stats: LoopStats  # the loop's state before its first step


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[EngineOutput]
    stats: LoopStats | None = None


class AdminReply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: DefragmentResult | None = None
    error: str | None = None


class Fatal(msgspec.Struct, tag=True, array_like=True):
    """The core cannot go on (e.g. out of memory at every step size) and exits non-zero."""

    reason: str


ToCore = AddRequest | AbortRequests | AdminRequest | Draining | Shutdown
FromCore = Ready | StepOutputs | AdminReply | Fatal


@dataclass(frozen=True)
class CoreAddresses:
    """Where the sockets live: the core binds `inbox` (every front end connects to it) and
    front end i binds `outbox(i)` (the core connects to each)."""

    directory: str  # a private directory for the IPC socket files

    @property
    def inbox(self) -> str:
        return f"ipc://{self.directory}/core-in"

    def outbox(self, client_index: int) -> str:
        return f"ipc://{self.directory}/front-{client_index}"


def _encode_extra(obj: Any) -> Any:
    if isinstance(obj, MappingProxyType):
        return dict(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in an engine message")


class Codec:
    """MessagePack encoding of one direction's messages (`ToCore` or `FromCore`)."""

    def __init__(self, decodes: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(decodes)

    def encode(self, message: ToCore | FromCore) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        """The message, or msgspec.DecodeError (a ValueError) for bytes of no known type."""
        return self._decoder.decode(data)


def to_core_codec() -> Codec:
    return Codec(ToCore)


def from_core_codec() -> Codec:
    return Codec(FromCore)
