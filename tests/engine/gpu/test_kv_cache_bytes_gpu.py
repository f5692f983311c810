"""--kv-cache-memory-bytes on a real GPU: the pool the runner allocates is the request within one
block (one block per layer of this model's shard: a block spans every layer), whatever the
utilization; a request beyond the free memory refuses to start (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.memory.budget import MemoryBudgetError
from tests.engine.checkpoints import make_runner, write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_pool_is_the_request_within_one_block(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    requested = 64 * 2**20 + 12_345
    runner = make_runner(
        tmp_path,
        device="cuda",
        dtype="bfloat16",
        num_gpu_blocks_override=None,
        kv_cache_memory_bytes=requested,
        max_num_batched_tokens=256,
    )
    assert runner.memory_budget is not None
    (budget,) = runner.memory_budget.per_rank
    allocated = runner.pools.device_pool.nbytes
    assert allocated == runner.num_gpu_blocks * runner.bytes_per_block == budget.kv_cache_allocated
    assert 0 <= requested - allocated < runner.bytes_per_block
    assert budget.terms["kv_cache_requested"] == budget.kv_cache == requested
    assert budget.allowed == (
        budget.weights
        + budget.peak_activations
        + budget.non_torch
        + budget.fragmentation_buffer
        + requested
    )


def test_a_request_beyond_the_free_memory_refuses_to_start(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(MemoryBudgetError, match=r"--kv-cache-memory-bytes .* asks for"):
        make_runner(
            tmp_path,
            device="cuda",
            dtype="bfloat16",
            num_gpu_blocks_override=None,
            kv_cache_memory_bytes=free,
            max_num_batched_tokens=256,
        )
