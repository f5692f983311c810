"""The start-up memory budget: how many KV blocks fit, from measured terms. Pure arithmetic.

    allowed  = gpu_memory_utilization x total
    kv_cache = allowed - weights - peak_activations - non_torch - fragmentation_buffer

or, under --kv-cache-memory-bytes N, the other way round:

    kv_cache = N
    allowed  = weights + peak_activations + non_torch + fragmentation_buffer + N

The formula, the KV block's bytes and the fragmentation buffer's rule live in
`pagekeeper_memplan.budget`, which the operator's plan shares. Every term is measured by the
profiler (`memory.profile`) except the fragmentation buffer when it is given as a size. The
engine refuses to start, naming every term, when the KV cache cannot hold one max-model-len
request or when the GPU has less free memory than this instance asks for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagekeeper_memplan.budget import (
    FRAGMENTATION_SAFETY_FACTOR,
    MIN_FRAGMENTATION_BUFFER,
    GiB,
    KVLayout,
    MiB,
    blocks_for,
    fragmentation_buffer,
    kv_cache_bytes,
)

# The shared arithmetic is re-exported: the engine's modules and tests import it from here.
__all__ = [
    "CPU_KV_MEMORY_FRACTION",
    "FRAGMENTATION_SAFETY_FACTOR",
    "MIN_FRAGMENTATION_BUFFER",
    "GiB",
    "KVLayout",
    "MemoryBudget",
    "MemoryBudgetError",
    "MemoryMeasurements",
    "MiB",
    "RankBudgets",
    "check_num_blocks",
    "combine_rank_budgets",
    "compute_budget",
    "fragmentation_buffer",
    "num_cpu_kv_blocks",
]

CPU_KV_MEMORY_FRACTION = 0.25  # at most this share of host RAM for the KV cache on the CPU


@dataclass(frozen=True)
class MemoryMeasurements:
    """What the profiler measured on this GPU, in bytes."""

    total: int  # the device's total memory
    free_at_start: int  # free before this process allocated anything (other tenants excluded)
    weights: int  # allocated by the model's parameters and buffers
    peak_activations: int  # peak allocated during the worst-case profile run, minus weights
    non_torch: int  # used by this process outside the caching allocator (CUDA context, cuBLAS)
    warmup_fragmentation: int  # allocator reserved - allocated after the mixed warm-up


@dataclass(frozen=True)
class MemoryBudget:
    """The decided budget. `terms` is what /metrics exports as pagekeeper_memory_budget_bytes."""

    total: int
    free_at_start: int
    allowed: int
    weights: int
    peak_activations: int
    non_torch: int
    measured_fragmentation: int  # the warm-up's reserved - allocated, before the safety factor
    fragmentation_buffer: int
    kv_cache: int
    num_blocks: int
    bytes_per_block: int
    kv_cache_requested: int | None = None  # --kv-cache-memory-bytes, when given

    @property
    def kv_cache_allocated(self) -> int:
        """The pool's bytes: whole blocks, within one block of `kv_cache`."""
        return self.num_blocks * self.bytes_per_block

    @property
    def terms(self) -> dict[str, int]:
        requested = (
            {}
            if self.kv_cache_requested is None
            else {"kv_cache_requested": self.kv_cache_requested}
        )
        return {
            "total": self.total,
            "free_at_start": self.free_at_start,
            "allowed": self.allowed,
            "weights": self.weights,
            "peak_activations": self.peak_activations,
            "non_torch": self.non_torch,
            "measured_fragmentation": self.measured_fragmentation,
            "fragmentation_buffer": self.fragmentation_buffer,
            "kv_cache": self.kv_cache,
            **requested,
        }

    def describe(self) -> str:
        return ", ".join(f"{name}={_fmt(value)}" for name, value in self.terms.items())


class MemoryBudgetError(RuntimeError):
    """The engine cannot start within its budget; the message names every term."""


def compute_budget(
    measured: MemoryMeasurements,
    layout: KVLayout,
    gpu_memory_utilization: float,
    requested_buffer: int | str,
    max_model_len: int,
    kv_cache_memory_bytes: int | None = None,
) -> MemoryBudget:
    """Size the KV cache, or raise MemoryBudgetError with every term in the message.

    `kv_cache_memory_bytes` (given) is the KV cache itself, and `gpu_memory_utilization` is
    then unused: what this instance asks for is the sum of the terms."""
    assert 0.0 < gpu_memory_utilization <= 1.0, gpu_memory_utilization
    buffer = fragmentation_buffer(measured.warmup_fragmentation, requested_buffer)
    others = measured.weights + measured.peak_activations + measured.non_torch + buffer
    if kv_cache_memory_bytes is None:
        allowed = int(gpu_memory_utilization * measured.total)
        kv_cache = kv_cache_bytes(
            allowed, measured.weights, measured.peak_activations, measured.non_torch, buffer
        )
        asking = f"--gpu-memory-utilization {gpu_memory_utilization} asks for"
        why = "another process holds the difference"
        lower = "lower the utilization"
        grow = "raise --gpu-memory-utilization"
    else:
        assert kv_cache_memory_bytes > 0, kv_cache_memory_bytes
        kv_cache = kv_cache_memory_bytes
        allowed = others + kv_cache
        asking = f"--kv-cache-memory-bytes {kv_cache_memory_bytes} with the other terms asks for"
        why = "the KV cache asked for does not fit beside the other terms"
        lower = "lower --kv-cache-memory-bytes"
        grow = "raise --kv-cache-memory-bytes"
    num_blocks = max(kv_cache, 0) // layout.bytes_per_block
    budget = MemoryBudget(
        total=measured.total,
        free_at_start=measured.free_at_start,
        allowed=allowed,
        weights=measured.weights,
        peak_activations=measured.peak_activations,
        non_torch=measured.non_torch,
        measured_fragmentation=measured.warmup_fragmentation,
        fragmentation_buffer=buffer,
        kv_cache=max(kv_cache, 0),
        num_blocks=num_blocks,
        bytes_per_block=layout.bytes_per_block,
        kv_cache_requested=kv_cache_memory_bytes,
    )
    if measured.free_at_start < allowed:
        raise MemoryBudgetError(
            f"the GPU has {_fmt(measured.free_at_start)} free but {asking} {_fmt(allowed)} of "
            f"{_fmt(measured.total)}: {why}; {lower} or free the GPU ({budget.describe()})"
        )
    blocks_needed = blocks_for(max_model_len, layout.block_size)
    if num_blocks < blocks_needed:
        raise MemoryBudgetError(
            f"the KV cache holds {num_blocks} blocks of {layout.block_size} tokens but one "
            f"--max-model-len {max_model_len} request needs {blocks_needed} "
            f"({_fmt(blocks_needed * layout.bytes_per_block)}); {grow}, "
            f"lower --max-model-len or --max-num-batched-tokens ({budget.describe()})"
        )
    return budget


@dataclass(frozen=True)
class RankBudgets:
    """The budgets of every tensor-parallel rank, and the block count they share: each rank
    holds its own shard of every block, so the smallest rank's count is the engine's."""

    per_rank: list[MemoryBudget]

    @property
    def num_blocks(self) -> int:
        return min(b.num_blocks for b in self.per_rank)

    @property
    def limiting_rank(self) -> int:
        return min(range(len(self.per_rank)), key=lambda r: self.per_rank[r].num_blocks)

    @property
    def terms(self) -> list[dict[str, int]]:
        return [b.terms for b in self.per_rank]


def combine_rank_budgets(outcomes: list[MemoryBudget | str]) -> RankBudgets:
    """One outcome per rank, in rank order: its budget, or why it refused. Any refusal refuses
    the engine, naming each failing rank with its message (every term); a single rank's
    message is passed on as it is."""
    failures = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, str)]
    if failures:
        if len(outcomes) == 1:
            raise MemoryBudgetError(failures[0][1])
        raise MemoryBudgetError("; ".join(f"rank {rank}: {message}" for rank, message in failures))
    return RankBudgets([o for o in outcomes if isinstance(o, MemoryBudget)])


def num_cpu_kv_blocks(
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    bytes_per_block: int,
    host_memory_bytes: int,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """Blocks for a CPU run: every sequence at full length, bounded by a share of host RAM;
    or exactly the blocks `kv_cache_memory_bytes` holds, when given."""
    if kv_cache_memory_bytes is not None:
        num_blocks = kv_cache_memory_bytes // bytes_per_block
        where = f"--kv-cache-memory-bytes {kv_cache_memory_bytes} ({num_blocks} blocks of "
        where += f"{bytes_per_block} bytes)"
    else:
        wanted = math.ceil(max_num_seqs * max_model_len / block_size)
        affordable = int(host_memory_bytes * CPU_KV_MEMORY_FRACTION) // bytes_per_block
        num_blocks = min(wanted, affordable)
        where = f"the CPU KV cache budget ({affordable} blocks of {bytes_per_block} bytes, "
        where += f"{CPU_KV_MEMORY_FRACTION:.0%} of host memory)"
    if num_blocks * block_size < max_model_len:
        raise MemoryBudgetError(
            f"{where} cannot hold one --max-model-len {max_model_len} request; lower "
            f"--max-model-len, or raise --kv-cache-memory-bytes or --num-gpu-blocks-override"
        )
    return num_blocks


def check_num_blocks(num_blocks: int, block_size: int, max_model_len: int, source: str) -> int:
    """`num_blocks` (block 0 being the null block) if they hold one max-model-len request."""
    num_needed = math.ceil(max_model_len / block_size)
    if num_blocks - 1 < num_needed:
        raise MemoryBudgetError(
            f"{source} {num_blocks} leaves {num_blocks - 1} usable blocks of {block_size} "
            f"tokens; one --max-model-len {max_model_len} request needs {num_needed}"
        )
    return num_blocks


def _fmt(num_bytes: int) -> str:
    if abs(num_bytes) >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / MiB:.1f} MiB"
