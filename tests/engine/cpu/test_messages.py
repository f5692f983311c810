"""The process boundary's messages: every type round-trips through its codec exactly, and bytes of
no known type (or of the other direction) are refused rather than turned into objects."""

from __future__ import annotations

import asyncio
import tempfile
from types import MappingProxyType

import msgspec
import pytest

from pagekeeper_engine.core.limits import EngineLimits
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend.client import EngineDeadError
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_engine.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    AdminReply,
    AdminRequest,
    CoreAddresses,
    DefragmentResult,
    EngineOutput,
    Fatal,
    LoopStats,
    Ready,
    Shutdown,
    StepOutputs,
    from_core_codec,
    to_core_codec,
)
from tests.engine.fakes import CharTokenizer


def stats() -> LoopStats:
    return LoopStats(
        *range(3), 0.25, *range(5), 0.125, *range(13),  # type: ignore[arg-type]
        num_requests_success=MappingProxyType({"stop": 1, "length": 2, "abort": 3}),
        num_oom_events={"step": 1, "swap": 0, "startup": 0},
        step_token_budget=4096,
        max_step_token_budget=8192,
        allocator=AllocatorStats(1000, 700, 200, 2, 0),
        num_consecutive_failed_steps=1,
    )  # fmt: skip


def ready(version: int = PROTOCOL_VERSION) -> Ready:
    return Ready(
        version, EngineLimits(4096, 8192, 256, 2304), 16, 1000, 50, "float8_e4m3fn",
        [{"weights": 1, "kv_cache": 2}, {"weights": 1, "kv_cache": 3}], True, True, stats(),
    )  # fmt: skip


TO_CORE = [
    AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, stop=("x",), seed=7), 2),
    AddRequest(
        "r2",
        [4],
        SamplingParams(
            logit_bias=((3, -2.5), (9, 100.0)),
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.2,
            top_logprobs=5,
        ),
        0,
    ),
    AbortRequests(["r1", "r2"], "stop"),
    AdminRequest(4, 1, 0),
    Shutdown(),
]
FROM_CORE = [
    ready(),
    StepOutputs(
        [
            EngineOutput("r1", [5], False, None, 3, 1, 0, [-0.5]),
            EngineOutput("r3", [5], False, None, 3, 1, 0, [-0.5], top_logprobs=[[(5, -0.5)]]),
            EngineOutput("r2", [], True, "abort", 0, 0, 0, error="no", is_rejected=True),
        ],
        stats(),
    ),
    AdminReply(4, DefragmentResult(True, 0, 250, AllocatorStats(1, 1, 0, 0, 0), None, 0.5)),
    AdminReply(5, error="no caching allocator"),
    Fatal("3 out-of-memory errors in a row"),
]


@pytest.mark.parametrize("message", TO_CORE, ids=lambda m: type(m).__name__)
def test_front_end_messages_round_trip(message: object) -> None:
    codec = to_core_codec()
    assert codec.decode(codec.encode(message)) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("message", FROM_CORE, ids=lambda m: type(m).__name__)
def test_core_messages_round_trip(message: object) -> None:
    codec = from_core_codec()
    decoded = codec.decode(codec.encode(message))  # type: ignore[arg-type]
    assert decoded == message


def test_foreign_bytes_and_the_other_direction_are_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        to_core_codec().decode(b"\x93garbage")
    with pytest.raises(msgspec.ValidationError):  # a core message is no front-end message
        to_core_codec().decode(from_core_codec().encode(Fatal("x")))
    evil = msgspec.msgpack.encode(["os.system", "echo hi"])  # no type can be named in bytes
    with pytest.raises(msgspec.ValidationError):
        from_core_codec().decode(evil)


def test_a_core_of_another_protocol_version_is_refused() -> None:
    async def main() -> str | None:
        with tempfile.TemporaryDirectory(prefix="pk-msg-") as directory:
            client = CoreClient(CoreAddresses(directory), 0, CharTokenizer().decode_batch)
            try:
                client._on_ready(ready(PROTOCOL_VERSION + 1))
                with pytest.raises(EngineDeadError, match="protocol"):
                    await client.wait_ready()
                return client.dead_reason
            finally:
                await client.close()

    reason = asyncio.run(main())
    assert reason == (
        f"the engine core speaks protocol {PROTOCOL_VERSION + 1}, this front end {PROTOCOL_VERSION}"
    )
