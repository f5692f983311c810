"""--cpu-offload-gb on a real GPU: the same greedy tokens and log-probabilities as every layer
resident, bit for bit (the staged weights are exact copies and both runs take the same
kernels), and the GPU's weights drop by the offloaded bytes less the staging buffers
(skipped without a GPU)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks.engine_probes import greedy_logprobs
from benchmarks.shapes import SHAPES
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.model.offload_plan import GiB
from pagekeeper_engine.runner.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
OFFLOAD_GIB = 0.5  # of the Qwen3-0.6B shape's 0.88 GiB of projections: 18 of its 28 layers


def run(model_dir: Path, offload_gib: float) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """Greedy tokens with their log-probabilities, eagerly and with no timed kernel choice
    (what an offloaded runner does), and the weights the start-up profile measured."""
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
        swap_space=0.0,
        enforce_eager=True,
        cpu_offload_gb=offload_gib,
    )
    runner = ModelRunner(config, progress=False)
    # The resident run takes the offloaded run's kernels: cuBLAS for one row, no fused layer.
    for module in runner.model.modules():
        if isinstance(module, Linear):
            module.gemv_config = None
    runner.model.set_row_fusion(None)
    engine = LLMEngine(config, runner, runner.eos_token_ids)
    picked = greedy_logprobs(engine, 8, 32, prompt_len=200)
    assert runner.memory_budget is not None
    weights = runner.memory_budget.per_rank[0].weights
    plan = runner.offload_plan
    if offload_gib:
        assert runner.graphs is None and runner.model.model.offload is not None
        assert plan.offloaded_bytes >= OFFLOAD_GIB * GiB
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return picked, weights if not offload_gib else weights + plan.saved_bytes


def test_offloaded_layers_give_the_same_tokens_and_free_their_memory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    resident, resident_weights = run(tmp_path, 0.0)
    offloaded, weights_plus_saved = run(tmp_path, OFFLOAD_GIB)
    assert offloaded == resident
    # weights + saved bytes: what the offloaded run would have measured with every layer
    # resident; allocator rounding aside, exactly the resident run's weights.
    assert abs(weights_plus_saved - resident_weights) <= 2**20
