"""How many KV blocks the runner allocates: as given, from host memory on the CPU, or from the
measured start-up budget on a GPU (`memory/profile.py`, `memory/budget.py`).

Under tensor parallelism every rank decides for its own shard of a block, then all take the
smallest count. A rank whose budget refuses still joins the exchange, so every rank refuses
together, with each failing rank named beside its terms, instead of the others waiting in a
collective.
"""

from __future__ import annotations

import logging
import os

import torch

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.memory.budget import (
    KVLayout,
    MemoryBudget,
    MemoryBudgetError,
    RankBudgets,
    check_num_blocks,
    combine_rank_budgets,
    num_cpu_kv_blocks,
)
from pagekeeper_engine.memory.cuda import CudaMemoryReader
from pagekeeper_engine.memory.profile import ProfileShapes, ProfileTarget, size_kv_cache
from pagekeeper_memplan.budget import kv_cache_blocks

logger = logging.getLogger(__name__)


def decide_num_gpu_blocks(
    target: ProfileTarget,
    config: EngineConfig,
    tp: TensorParallelGroup,
    device: torch.device,
    layout: KVLayout,
    shapes: ProfileShapes,
    free_at_start: int | None,
) -> tuple[int, RankBudgets | None]:
    """The block count every rank allocates, and the measured budgets behind it (None when the
    count was given or on the CPU). `target` is the runner the profile steps (on a GPU, whose
    free bytes before it allocated anything are `free_at_start`)."""
    if config.num_gpu_blocks_override is not None:
        num_blocks = check_num_blocks(
            config.num_gpu_blocks_override,
            layout.block_size,
            shapes.max_model_len,
            "--num-gpu-blocks-override",
        )
        return num_blocks, None
    if device.type == "cpu":
        host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        num_blocks = num_cpu_kv_blocks(
            max_num_seqs=config.max_num_seqs,
            max_model_len=shapes.max_model_len,
            block_size=layout.block_size,
            bytes_per_block=layout.bytes_per_block,
            host_memory_bytes=host_memory,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        )
        gathered = tp.all_gather_object(num_blocks)
        return min(n for n in gathered if isinstance(n, int)), None
    assert free_at_start is not None, "a GPU's free memory is read before anything is loaded"
    budgets = measure_rank_budgets(target, config, tp, device, layout, shapes, free_at_start)
    has_host_tier = config.kv_offloading_size > 0
    return kv_cache_blocks(budgets.num_blocks, layout.bytes_per_block, has_host_tier), budgets


def measure_rank_budgets(
    target: ProfileTarget,
    config: EngineConfig,
    tp: TensorParallelGroup,
    device: torch.device,
    layout: KVLayout,
    shapes: ProfileShapes,
    free_at_start: int,
) -> RankBudgets:
    """Profile this rank, then exchange the outcomes; MemoryBudgetError names every failing
    rank."""
    outcome: MemoryBudget | str
    try:
        outcome = size_kv_cache(
            target, CudaMemoryReader(device), shapes, layout, config, free_at_start
        )
    except MemoryBudgetError as exc:
        outcome = str(exc)
    gathered = tp.all_gather_object(outcome)
    budgets = combine_rank_budgets([o if isinstance(o, MemoryBudget) else str(o) for o in gathered])
    if len(budgets.per_rank) > 1 and tp.is_first:
        logger.info(
            "KV blocks per rank %s: every rank allocates %d (rank %d's)",
            [b.num_blocks for b in budgets.per_rank],
            budgets.num_blocks,
            budgets.limiting_rank,
        )
    return budgets
