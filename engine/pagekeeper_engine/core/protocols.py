"""What the step loop needs from the model runner and the device's allocator.

Structural protocols, so the loop imports no torch: `runner.runner.ModelRunner` and
`memory.cuda.CudaAllocatorMonitor` satisfy them without importing this module, and the CPU tests
pass fakes. Also how the loop picks up a runner's optional ability to launch a step without
waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import EngineLimits
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.memory.allocator import AllocatorStats


class AllocatorMonitorProtocol(Protocol):
    """The device's caching allocator (`memory.cuda.CudaAllocatorMonitor`); absent on the CPU."""

    def read(self) -> AllocatorStats: ...

    def release_cached(self) -> int: ...


class ModelRunnerProtocol(Protocol):
    """Runs one scheduled step on the device and samples; owns the KV-cache tensors.

    `execute` first issues the host tier's copies (`kv_loads`, `kv_stores`, beside the step,
    fenced by `kv_fence`: `core.kv_copies`), applies `blocks_to_swap_out` (GPU -> CPU) and
    `blocks_to_swap_in` (CPU -> GPU) - a step never has both - then the forward pass. Block 0
    of the GPU pool is never given to a sequence (free to use as padding).
    """

    @property
    def limits(self) -> EngineLimits:
        """The engine's limits, resolved once from the flags and the model."""
        ...

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier (0: none); `host_block_bytes` each, over all ranks."""
        ...

    @property
    def host_block_bytes(self) -> int: ...

    @property
    def kv_load_seconds(self) -> float:
        """Device seconds the host tier's loads took so far (those known to be done)."""
        ...

    @property
    def num_swap_ooms(self) -> int:
        """Swaps that found no device memory and fell back to an allocation-free copy."""
        ...

    @property
    def grammar_timings(self) -> GrammarTimings:
        """Histograms of structured steps' grammar work on the host so far (none observed by
        a runner without schemas)."""
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
