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
from typing import TYPE_CHECKING

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
from pagekeeper_engine.memory.profile import ProfileShapes, size_kv_cache

if TYPE_CHECKING:
    from pagekeeper_engine.runner.runner import ModelRunner

logger = logging.getLogger(__name__)


def decide_num_gpu_blocks(runner: ModelRunner) -> tuple[int, RankBudgets | None]:
    """The block count every rank allocates, and the measured budgets behind it (None when the
    count was given or on the CPU)."""
    config = runner.config
    if config.num_gpu_blocks_override is not None:
        num_blocks = check_num_blocks(
            config.num_gpu_blocks_override,
            runner.block_size,
            runner.max_model_len,
            "--num-gpu-blocks-override",
        )
        return num_blocks, None
    if runner.device.type == "cpu":
        host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        num_blocks = num_cpu_kv_blocks(
            max_num_seqs=config.max_num_seqs,
            max_model_len=runner.max_model_len,
            block_size=runner.block_size,
            bytes_per_block=runner.bytes_per_block,
            host_memory_bytes=host_memory,
        )
        gathered = runner.tp.all_gather_object(num_blocks)
        return min(n for n in gathered if isinstance(n, int)), None
    budgets = measure_rank_budgets(runner)
    return budgets.num_blocks, budgets


def measure_rank_budgets(runner: ModelRunner) -> RankBudgets:
    """Profile this rank, then exchange the outcomes; MemoryBudgetError names every failing
    rank."""
    cfg = runner.model_config
    layout = KVLayout(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        runner.block_size,
        runner.kv_cache_dtype.itemsize,
    )
    shapes = ProfileShapes(
        runner.max_num_batched_tokens,
        runner.config.max_num_seqs,
        runner.max_model_len,
        runner.block_size,
    )
    outcome: MemoryBudget | str
    try:
        outcome = size_kv_cache(
            runner,
            CudaMemoryReader(runner.device),
            shapes,
            layout,
            runner.config,
            runner.free_at_start,
        )
    except MemoryBudgetError as exc:
        outcome = str(exc)
    gathered = runner.tp.all_gather_object(outcome)
    budgets = combine_rank_budgets([o if isinstance(o, MemoryBudget) else str(o) for o in gathered])
    if len(budgets.per_rank) > 1 and runner.tp.is_first:
        logger.info(
            "KV blocks per rank %s: every rank allocates %d (rank %d's)",
            [b.num_blocks for b in budgets.per_rank],
            budgets.num_blocks,
            budgets.limiting_rank,
        )
    return budgets
