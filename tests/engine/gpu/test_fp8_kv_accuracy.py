"""The FP8 KV cache against the bf16 one on the Qwen3-0.6B shape (random weights): the same
greedy tokens and nearly the same log-probabilities, and twice the KV blocks.

Thresholds come from `benchmarks/throughput.py --accuracy` on an H200 (docs/benchmarks.md, run
13: 32 prompts x 128 steps gave 100% identical tokens, |d logprob| mean 0.00053 and max 0.0020);
they leave about 3x headroom for this smaller sample.
"""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import SHAPES
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.engine import LLMEngine
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.runner.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (compute capability 8.9 or newer)",
    ),
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
    rng = random.Random(1)
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True, logprobs=True)
    for i in range(NUM_PROMPTS):
        engine.add_request(f"p{i}", [rng.randrange(1000, 30000) for _ in range(256)], params)
    picked: dict[str, list[tuple[int, float]]] = {}
    while engine.has_work():
        for out in engine.step():
            for token, logprob in zip(out.new_token_ids, out.logprobs, strict=True):
                assert logprob is not None
                picked.setdefault(out.request_id, []).append((token, logprob))
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
    pairs = [(a, b) for rid in bf16 for a, b in zip(bf16[rid], fp8[rid], strict=True)]
    assert len(pairs) == NUM_PROMPTS * NUM_STEPS
    identical = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    diffs = [abs(a[1] - b[1]) for a, b in pairs if a[0] == b[0]]
    assert identical >= 0.95
    assert sum(diffs) / len(diffs) <= 0.002
    assert max(diffs) <= 0.01
