"""What the step loop needs from the model runner, the tokenizer and the device's allocator.

Structural protocols, so the loop imports no torch: `runner.ModelRunner`, `tokenizer.Tokenizer`
and `memory.cuda.CudaAllocatorMonitor` satisfy them without importing this module, and the CPU
tests pass fakes. Also how the loop picks up a runner's optional abilities (launching a step
without waiting for it, detokenizing a batch in one call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.detokenize import DecodeBatch
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.memory.allocator import AllocatorStats


class AllocatorMonitorProtocol(Protocol):
    """The device's caching allocator (`memory.cuda.CudaAllocatorMonitor`); absent on the CPU."""

    def read(self) -> AllocatorStats: ...

    def release_cached(self) -> int: ...


class ModelRunnerProtocol(Protocol):
    """Runs one scheduled step on the device and samples; owns the KV-cache tensors.

    `execute` first applies `blocks_to_swap_out` (GPU -> CPU) and `blocks_to_swap_in`
    (CPU -> GPU) - a step never has both - then the forward pass. Block 0 of the GPU pool is
    never given to a sequence (free to use as padding).
    """

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    @property
    def num_swap_ooms(self) -> int:
        """Swaps that found no device memory and fell back to an allocation-free copy."""
        ...

    @property
    def allocator_monitor(self) -> AllocatorMonitorProtocol | None: ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Raises DeviceOutOfMemoryError, having freed the step's memory, when the device
        runs out; the KV cache holds what it held before the step."""
        ...


class PendingStepProtocol(Protocol):
    """A launched step whose sampled tokens are still on their way to the host."""

    def result(self) -> RunnerOutput:
        """Wait for the tokens (the same object `execute` would have returned)."""
        ...


class AsyncModelRunnerProtocol(ModelRunnerProtocol, Protocol):
    """A runner that can launch a step without waiting for it.

    `launch` enqueues the step and returns at once; a row whose input token is
    `PLACEHOLDER_TOKEN_ID` takes the token the previous launched step sampled for the same
    request. `result()` of a step must be called before the step after next is launched.
    """

    @property
    def prefers_async_scheduling(self) -> bool:
        """Whether overlapping pays (a device that runs beside the host)."""
        ...

    def launch(self, out: SchedulerOutput) -> PendingStepProtocol: ...


class TokenizerProtocol(Protocol):
    """Text <-> token ids. `decode` is what the client sees (special tokens skipped).

    A tokenizer that also has `decode_batch(list[list[int]]) -> list[str]` (the same as
    `decode` on each) lets the loop detokenize a whole step in one call.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def resolve_decode_batch(tokenizer: TokenizerProtocol) -> DecodeBatch:
    """The tokenizer's `decode_batch`, or `decode` on each window where it has none."""
    decode_batch: DecodeBatch | None = getattr(tokenizer, "decode_batch", None)
    return decode_batch or (lambda windows: [tokenizer.decode(w) for w in windows])


def resolve_launch(
    config: EngineConfig, runner: ModelRunnerProtocol
) -> Callable[[SchedulerOutput], PendingStepProtocol] | None:
    """The runner's `launch` when steps are to overlap: `config.async_scheduling`, or where
    it is unset, the runner's preference."""
    launch = getattr(runner, "launch", None)
    wanted = config.async_scheduling
    if wanted is None:
        wanted = bool(getattr(runner, "prefers_async_scheduling", False))
    if not wanted:
        return None
    if launch is None:
        raise ValueError("asynchronous scheduling needs a runner that can launch steps")
    return launch  # type: ignore[no-any-return]
