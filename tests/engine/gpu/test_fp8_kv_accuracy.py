"""The FP8 KV cache against the bf16 one on the Qwen3-0.6B shape (random weights): the same
greedy tokens and nearly the same log-probabilities, and twice the KV blocks.

Thresholds come from `benchmarks/throughput.py --accuracy` on an H200 (docs/benchmarks-archive.md,
"FP8 KV cache accuracy": 32 prompts x 128 steps gave 100% identical tokens, |d logprob| mean 0.00053
and max 0.0020); they leave about 3x headroom for this smaller sample.
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
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.kernels.paged_cases import needs_fp8_gpu

pytestmark = [
    pytest.mark.gpu,
    needs_fp8_gpu,
]
NUM_PROMPTS, NUM_STEPS = 8, 64


def greedy(model_dir: Path, kv_cache_dtype: str) -> tuple[dict[str, list[tuple[int, float]]], int]:
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
        swap_space=0.0,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(config, progress=False)
    engine = LLMEngine(config, runner, runner.eos_token_ids)
    picked = greedy_logprobs(engine, NUM_PROMPTS, NUM_STEPS, prompt_len=256)
    num_blocks = runner.num_gpu_blocks
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return picked, num_blocks


def test_fp8_kv_keeps_the_greedy_tokens_and_doubles_the_blocks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    bf16, bf16_blocks = greedy(tmp_path, "auto")
    fp8, fp8_blocks = greedy(tmp_path, "fp8")
    assert fp8_blocks >= 1.95 * bf16_blocks
    accuracy = compare_greedy(bf16, fp8)
    assert accuracy["num_positions"] == NUM_PROMPTS * NUM_STEPS
    assert accuracy["identical_token_share"] >= 0.95
    assert accuracy["logprob_abs_diff_mean"] <= 0.002
    assert accuracy["logprob_abs_diff_max"] <= 0.01
