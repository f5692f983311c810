"""Preemption: whether a sequence gives back its GPU blocks by swap or by recompute, and the
block moves of each (and of a swapped sequence's return).

Pure Python; never imports torch. These functions move one sequence's blocks and set its
status; the scheduler owns the queues and the counters.
"""

from __future__ import annotations

import enum

from pagekeeper_engine.core.block_pool import BlockPool
from pagekeeper_engine.core.kv_manager import KVCacheManager
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus


class PreemptionMode(enum.Enum):
    """How a preempted sequence gives back its GPU blocks (see `choose_preemption_mode`)."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


def choose_preemption_mode(
    num_computed_tokens: int,
    num_free_cpu_blocks: int,
    num_blocks_to_swap: int,
    min_swap_tokens: int,
) -> PreemptionMode:
    """Swap or recompute a preempted sequence.

    Swapping copies each computed block over PCIe twice (out now, in later): cost linear in the
    tokens held. Recomputing re-runs their prefill, whose matmuls are linear and whose attention
    is quadratic in the tokens held, so it is the cheaper choice for short sequences and the
    dearer one past a length that depends on the model (for a 0.6B model recompute wins to a few
    hundred tokens; for 8B, swap wins almost always). Rule: swap when the CPU pool can take
    every computed block and the sequence holds at least `min_swap_tokens` computed tokens;
    otherwise recompute.
    """
    if num_computed_tokens >= max(1, min_swap_tokens) and num_blocks_to_swap <= num_free_cpu_blocks:
        return PreemptionMode.SWAP
    return PreemptionMode.RECOMPUTE


def swap_out(
    seq: Sequence, kv: KVCacheManager, cpu_pool: BlockPool, num_blocks: int
) -> list[tuple[int, int]]:
    """Move the first `num_blocks` (the computed ones) of `seq` to CPU blocks; it becomes
    SWAPPED holding only those. Returns the (GPU, CPU) block pairs to copy."""
    cpu_ids = cpu_pool.allocate(num_blocks)
    pairs = list(zip(seq.block_ids[:num_blocks], cpu_ids, strict=True))
    kv.free(seq)
    seq.block_ids = cpu_ids
    seq.status = SequenceStatus.SWAPPED
    return pairs


def swap_in(seq: Sequence, kv: KVCacheManager, cpu_pool: BlockPool) -> list[tuple[int, int]]:
    """Give a swapped sequence GPU blocks for all its tokens and free its CPU blocks; it becomes
    RUNNING with its computed blocks registered again. Returns the (CPU, GPU) pairs to copy."""
    cpu_ids = seq.block_ids
    gpu_ids = kv.allocate_for_swap_in(seq)
    cpu_pool.free(cpu_ids)
    pairs = list(zip(cpu_ids, gpu_ids[: len(cpu_ids)], strict=True))
    seq.block_ids = gpu_ids
    seq.num_registered_blocks = 0
    kv.cache_computed_blocks(seq)
    seq.status = SequenceStatus.RUNNING
    return pairs


def reset_for_recompute(seq: Sequence, kv: KVCacheManager) -> None:
    """Free every block of `seq` and forget its computation; it becomes WAITING. Its full blocks
    stay in the prefix cache, so the recompute is mostly cache hits."""
    kv.free(seq)
    seq.num_computed_tokens = 0
    seq.status = SequenceStatus.WAITING
