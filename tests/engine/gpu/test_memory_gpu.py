"""The allocator readings and the start-up profile on a real GPU (skipped without one)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import SHAPES
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.memory.cuda import CudaAllocatorMonitor
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import make_runner, seq, tokens, write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_monitor_reads_the_caching_allocator_and_releases_its_cache() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    monitor = CudaAllocatorMonitor(device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = monitor.read()
    # 3 MiB lands in the large pool, which reserves a 20 MiB segment for requests of 1-10 MiB:
    # 17 MiB of it stay reserved but unallocated, in one free block.
    block = torch.empty(3 * 2**20, dtype=torch.uint8, device=device)
    monitor.sampler._next_at = float("-inf")  # take a snapshot now
    after = monitor.read()
    assert after.reserved - before.reserved == 20 * 2**20
    assert after.allocated - before.allocated == 3 * 2**20
    assert 17 * 2**20 <= after.largest_free_block <= after.fragmentation
    del block
    assert monitor.release_cached() >= 20 * 2**20


def budgeted_runner(path: Path, utilization: float) -> ModelRunner:
    """The tiny Llama checkpoint on the GPU, its KV cache sized by the measured budget."""
    write_checkpoint(path, "llama")
    return make_runner(
        path,
        device="cuda",
        dtype="bfloat16",
        num_gpu_blocks_override=None,
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=256,
    )


def test_budget_on_the_gpu_names_every_term(tmp_path: Path) -> None:
    runner = budgeted_runner(tmp_path, 0.5)
    assert runner.memory_budget is not None
    (budget,) = runner.memory_budget.per_rank  # one GPU, one rank
    assert runner.memory_budget_bytes == [budget.terms]
    assert runner.num_gpu_blocks == budget.num_blocks > 0
    assert budget.kv_cache == (
        budget.allowed
        - budget.weights
        - budget.peak_activations
        - budget.non_torch
        - budget.fragmentation_buffer
    )
    assert budget.weights > 0 and budget.peak_activations > 0


def test_a_ready_runner_holds_no_more_than_its_budget_measured(tmp_path: Path) -> None:
    # Once ready, the caching allocator holds the weights, the KV pool and the peak activations
    # (the workspace, the sampler's rows, cuBLAS's workspaces and the graphs' pool among them),
    # nothing beside them: what start-up's kernel timing leaves allocated is in the budget
    # (docs/benchmarks-archive.md, "what the start-up choices left outside the budget").
    runner = budgeted_runner(tmp_path, 0.3)
    assert runner.graphs is not None and runner.gemv_choices
    assert runner.memory_budget is not None
    (budget,) = runner.memory_budget.per_rank
    torch.cuda.synchronize()
    kv_pool = runner.num_gpu_blocks * runner.bytes_per_block
    held = torch.cuda.memory_allocated() - budget.weights - kv_pool
    assert held <= budget.peak_activations, (held, budget.terms)


def test_a_prefill_forward_allocates_nothing_beside_its_workspace(tmp_path: Path) -> None:
    # Every per-token temporary of the forward pass lives in the preallocated workspace, so
    # the caching allocator sees no allocation of the step's size (nothing to fragment).
    write_checkpoint(tmp_path, "qwen3")  # q/k norm and the chunked MLP both in play
    runner = make_runner(tmp_path, device="cuda", dtype="bfloat16", max_num_batched_tokens=64)
    prompts = [seq("a", tokens(40), 0, [1, 2, 3, 4, 5]), seq("b", tokens(17), 0, [6, 7, 8])]
    with torch.inference_mode():
        step = runner.prepare_inputs(prompts)
        runner.model(step.input_ids, step.positions, step.meta)  # compiles the kernels
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        hidden = runner.model(step.input_ids, step.positions, step.meta)
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before
    assert hidden.data_ptr() == runner.workspace.rows("hidden", 57).data_ptr()


def test_start_up_leaves_no_large_free_block_in_the_cache(tmp_path: Path) -> None:
    # Dummy weights are drawn at their checkpoint size, then cut to the rank's slice. At W-burst's
    # settings the sampler's rows were carved from a cached draw of the 8B shape, and the rest of it
    # (689 MiB) stayed reserved where nothing could use it (docs/benchmarks-archive.md,
    # "double-buffered FP8 decode tiles"). One layer keeps the shape's vocabulary and hidden size;
    # without the release after loading, the largest free block here is 401 MiB.
    (tmp_path / "config.json").write_text(
        json.dumps({**SHAPES["llama-3.1-8b"], "num_hidden_layers": 1})
    )
    config = EngineConfig(
        model=str(tmp_path),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=32768,
        max_num_seqs=256,
        max_num_batched_tokens=65536,
        num_gpu_blocks_override=4096,
        swap_space=0.0,
    )
    runner = ModelRunner(config, progress=False)
    torch.cuda.synchronize()
    free_blocks = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    assert max(free_blocks, default=0) < 64 * 2**20
