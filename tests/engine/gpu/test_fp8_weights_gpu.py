"""FP8 projection weights against bf16 on the same random-weight checkpoint (the Qwen3-0.6B
shape, `--load-format dummy`): nearly the same greedy tokens and log-probabilities through the
FP8 GEMMs, the FP8 GEMV and the CUDA graphs, and the projections' memory halved, as the
start-up profile measures it (skipped without an FP8 GPU).

The bounds are looser than the FP8 KV cache's (`test_fp8_kv_accuracy.py`): every projection's
weights are rounded to three mantissa bits, not only the cached keys and values.
`benchmarks/weights.py` records the measured figures at the Llama-3.1-8B shape.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks.engine_probes import compare_greedy, greedy_logprobs
from benchmarks.shapes import SHAPES
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.kernels.paged_cases import needs_fp8_gpu

LIBRARY_WORKSPACE = 64 * 2**20
pytestmark = [pytest.mark.gpu, needs_fp8_gpu]
NUM_PROMPTS, NUM_STEPS = 8, 64


def greedy(
    model_dir: Path, quantization: str
) -> tuple[dict[str, list[tuple[int, float]]], int, int]:
    """Greedy tokens with their log-probabilities, the measured weight bytes, and the bytes an
    FP8 model's projections save (0 for bf16): 1 byte per weight, less 4 per scale."""
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
        swap_space=0.0,
        quantization=quantization,
    )
    runner = ModelRunner(config, progress=False)
    engine = LLMEngine(config, runner, runner.eos_token_ids)
    picked = greedy_logprobs(engine, NUM_PROMPTS, NUM_STEPS, prompt_len=256)
    assert runner.memory_budget is not None
    weights = runner.memory_budget.per_rank[0].weights
    saved = sum(
        m.weight.numel() - 4 * m.weight_scale.numel()
        for m in runner.model.modules()
        if isinstance(m, Linear) and m.weight_scale is not None
    )
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return picked, weights, saved


def test_fp8_weights_keep_the_greedy_tokens_and_halve_the_projections(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    bf16, bf16_weights, _ = greedy(tmp_path, "none")
    fp8, fp8_weights, saved = greedy(tmp_path, "fp8")
    # The projections are 440 M of the 0.6B's 596 M parameters, 0.35 of its weight bytes once
    # the tied embedding (bf16) and the fp32 rotary tables are counted: the measured weights
    # drop by what they save, within 1%.
    assert saved > 0.34 * bf16_weights
    # On the H200 the FP8 run's term also held one 64 MiB workspace the bf16 run's did not (the
    # 8B's bf16 term holds one too, against the plan's exact bytes): a library's, allocated
    # before the profile, not yet attributed. One is allowed, no more.
    assert abs((bf16_weights - fp8_weights) - saved) <= 0.01 * saved + LIBRARY_WORKSPACE
    accuracy = compare_greedy(bf16, fp8)
    print(f"fp8 against bf16 on the 0.6B shape: {accuracy}")
    assert accuracy["num_positions"] == NUM_PROMPTS * NUM_STEPS
    # Random weights give near-flat logits, so one flipped near-tie sends a prompt's greedy text
    # elsewhere for good: the 8B shape kept 54% of 2,048 positions on the H200, with the chosen
    # token's log-probability 0.0013 apart on average (0.0059 at most) up to each divergence.
    assert accuracy["identical_token_share"] >= 0.5
    assert accuracy["logprob_abs_diff_mean"] <= 0.01
    assert accuracy["logprob_abs_diff_max"] <= 0.05
