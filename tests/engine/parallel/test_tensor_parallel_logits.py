"""Tensor parallelism on the CPU (gloo): 2 and 4 ranks compute what one process computes.

For Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm, tied embeddings), each rank loads only its
shard from the checkpoint; the gathered logits of a packed prefill step and of a mixed
decode-and-chunk step equal the single-process runner's to 1e-4 in fp32, and generation through
the step path gives the same tokens: greedy and seeded random batches picked across the ranks'
vocabulary shards, and a top-k batch that rank 0 samples from the gathered logits. The tiny
models have 2 KV heads, so 4 ranks replicate each one twice, and a vocabulary of 97, so the
last vocabulary shard carries padding. An FP8 checkpoint (Llama's, e4m3 projections with a
scale per output row) checks that the scales shard with their rows: whole on every rank for the
row-parallel o and down projections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import TOLERANCE, make_hf_model, write_checkpoint
from tests.engine.fp8_checkpoints import write_fp8_checkpoint
from tests.engine.parallel.ranks import (
    GPU_RANK_COUNTS,
    SAMPLINGS,
    generate,
    packed_steps,
    run_rank,
    runner_config,
    spawn_ranks,
    step_logits,
)

CASES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm-tied": ("qwen3", {"tie_word_embeddings": True}),
}
RESULT_TIMEOUT_S = 300.0  # spawning torch in 4 processes on a busy 2-core machine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    paths = []
    for name, (arch, overrides) in sorted(CASES.items()):
        path = tmp_path_factory.mktemp("tp") / name
        write_checkpoint(path, arch, **overrides)
        paths.append(path)
    fp8 = tmp_path_factory.mktemp("tp") / "llama-fp8-checkpoint"
    write_fp8_checkpoint(fp8, make_hf_model("llama"), per_tensor=False)
    paths.append(fp8)
    return paths


def run_ranks(size: int, paths: list[Path], device: str = "cpu") -> dict[str, Any]:
    """Run `size` rank processes over the checkpoints; rank 0's findings."""
    (found,) = spawn_ranks(run_rank, size, (paths, device), 1, RESULT_TIMEOUT_S)
    return dict(found)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_compute_what_one_process_computes(size: int, checkpoints: list[Path]) -> None:
    check_against_one_process(run_ranks(size, checkpoints), checkpoints, "cpu", TOLERANCE)


def check_against_one_process(
    found: dict[str, Any], checkpoints: list[Path], device: str, tolerance: float
) -> None:
    for path in checkpoints:
        single = ModelRunner(runner_config(path, 1, device=device), progress=False)
        arrays, generated, num_blocks = found[path.name]
        logits = [torch.from_numpy(a) for a in arrays]
        for step, seqs in enumerate(packed_steps()):
            expected = step_logits(single, seqs)
            assert expected is not None and logits[step] is not None
            expected = expected.cpu()
            assert logits[step].shape == expected.shape == (expected.shape[0], 97)
            row_diffs = (logits[step] - expected).abs().amax(dim=1)
            diff = row_diffs.max().item()
            assert diff < tolerance, (
                f"{path.name} step {step}: max |diff| {diff}, rows over the tolerance "
                f"{(row_diffs >= tolerance).nonzero().flatten().tolist()} of "
                f"{row_diffs.shape[0]}; all-reduces: {found['one_shot']}"
            )
        single = ModelRunner(runner_config(path, 1, device=device), progress=False)
        for name, params in SAMPLINGS.items():
            assert generated[name] == generate(single, True, params), (path.name, name)
        assert num_blocks == single.num_gpu_blocks
        assert torch.isfinite(logits[0]).all()
    dummy = ModelRunner(runner_config(checkpoints[0], 1, "dummy", device), progress=False)
    expected = step_logits(dummy, packed_steps()[0])
    assert expected is not None
    expected = expected.cpu()
    # dummy weights are tiny (U(-1e-3, 1e-3)), so compare relative to the logits' own scale
    scale = expected.abs().max().item()
    assert scale > 0
    row_diffs = (torch.from_numpy(found["dummy"]) - expected).abs().amax(dim=1)
    over = (row_diffs >= 1e-4 * scale).nonzero().flatten().tolist()
    assert not over, f"dummy weights: rows {over} of {row_diffs.shape[0]} over 1e-4 x {scale}"


@pytest.mark.gpu
@pytest.mark.parametrize("size", GPU_RANK_COUNTS)
def test_gpus_compute_what_one_computes(size: int, checkpoints: list[Path]) -> None:
    """NCCL, the Triton kernels and the decode graphs (each capturing its all-reduces), fp32;
    at 4 ranks the tiny models' 2 KV heads are replicated on pairs of ranks. Not the FP8
    checkpoint: FP8 weights run in bf16 on a GPU, not at this test's fp32 tolerance."""
    unquantized = [path for path in checkpoints if not path.name.endswith("fp8-checkpoint")]
    check_against_one_process(run_ranks(size, unquantized, "cuda"), unquantized, "cuda", 1e-3)
