"""The host KV tier on a GPU: pinned host blocks, the side stream, the staging buffer and the
fences, under asynchronous scheduling and CUDA graphs: multi-turn sessions whose contexts
outgrow the KV pool give the same greedy tokens with the tier as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.checkpoints import write_checkpoint
from tests.engine.cpu.test_host_tier_runner import serve_sessions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(path, "qwen3")
    return path


def test_greedy_tokens_are_the_same_with_the_tier_on_a_gpu(checkpoint: Path) -> None:
    without, plain = serve_sessions(checkpoint, 0.0, "cuda")
    with_tier, tiered = serve_sessions(checkpoint, 0.001, "cuda")
    assert with_tier == without
    assert tiered.prefix_cache_host_hits > 0 and plain.prefix_cache_host_hits == 0
    assert tiered.num_host_blocks_loaded * 8 == tiered.prefix_cache_host_hits
    assert tiered.num_batched_tokens_total < plain.num_batched_tokens_total
