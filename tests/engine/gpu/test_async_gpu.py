"""Asynchronous scheduling on the GPU (CUDA graphs, sampled ids gathered into the next step's
inputs on the device, results read back through pinned buffers) against the synchronous loop:
the same greedy tokens, stops and block accounting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine
from tests.engine.checkpoints import make_runner, tokens, write_checkpoint
from tests.engine.fakes import IdTokenizer, run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(path, "qwen3")
    return path


def generate(checkpoint: Path, async_scheduling: bool, params: list[SamplingParams]) -> Any:
    runner = make_runner(checkpoint, device="cuda", num_blocks=64, max_num_seqs=8)
    config = EngineConfig(
        model="tiny",
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config, runner, IdTokenizer().eos_token_ids)
    assert engine.is_async is async_scheduling
    assert runner.graphs is not None
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", tokens(5 + 4 * i, offset=13 * i + 1), p)
    outputs = run_all(engine)
    stats = engine.stats()
    return (
        {
            rid: [(o.new_token_ids, o.finished, o.finish_reason) for o in outs]
            for rid, outs in outputs.items()
        },
        (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks),
    )


def test_async_greedy_tokens_stops_and_blocks_equal_sync(checkpoint: Path) -> None:
    greedy = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 6
    sync_run = generate(checkpoint, False, greedy)
    assert generate(checkpoint, True, greedy) == sync_run
    # each request now stops on the token it produced fifth
    stops = [
        SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(outs[4][0][0],)
        )
        for outs in sync_run[0].values()
    ]
    sync_stopped = generate(checkpoint, False, stops)
    assert generate(checkpoint, True, stops) == sync_stopped
    assert all(outs[-1][2] == "stop" for outs in sync_stopped[0].values())
