"""The host KV tier under tensor parallelism on the CPU (gloo): each rank stores its shard of
a prefix's blocks in its own host pool and loads it back into other blocks, through the steps
rank 0 runs and the others follow; the prefix read from the loaded blocks gives the logits it
gave where it was computed, at 1 and 2 ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagekeeper_engine.core.kv_copies import CopyFence
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.distributed.group import TensorParallelGroup, join_rendezvous
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import BLOCK_SIZE, TOLERANCE, seq, tokens, write_checkpoint
from tests.engine.parallel.ranks import (
    LEAVE_TIMEOUT,
    follow_as_a_worker,
    runner_config,
    spawn_ranks,
    step_logits,
)

RESULT_TIMEOUT_S = 300.0  # spawning torch in 2 processes on a busy 2-core machine
PROMPT = tokens(2 * BLOCK_SIZE + 1, offset=3)


def copy_step(runner: ModelRunner, is_first: bool, **copies: Any) -> None:
    """A step of host-tier copies alone, as rank 0 runs it and the others follow it."""
    out = SchedulerOutput([], 0, kv_fence=CopyFence.ALL, **copies)
    if is_first:
        runner.execute(out)
    else:
        follow_as_a_worker(runner, out)


def round_trip(runner: ModelRunner, is_first: bool) -> tuple[Any, Any, Any]:
    """The prompt's last row: computed whole, read over its first two blocks loaded back from
    the host tier, and read over blocks nobody filled (the control)."""
    whole = step_logits(runner, [seq("x", PROMPT, 0, [1, 2, 3])])
    copy_step(runner, is_first, kv_stores=[(1, 0), (2, 1)])
    copy_step(runner, is_first, kv_loads=[(0, 5), (1, 6)])
    tail = PROMPT[2 * BLOCK_SIZE :]
    loaded = step_logits(runner, [seq("y", tail, 2 * BLOCK_SIZE, [5, 6, 7])])
    unfilled = step_logits(runner, [seq("z", tail, 2 * BLOCK_SIZE, [8, 9, 10])])
    rows = (whole, loaded, unfilled)
    return tuple(None if r is None else r[-1].numpy() for r in rows)  # type: ignore[return-value]


def run_rank(rank: int, size: int, port: int, path: Path, results: Any) -> None:
    torch.set_num_threads(1)
    group = TensorParallelGroup.initialize(
        rank, size, join_rendezvous(port, size), torch.device("cpu")
    )
    try:
        config = dataclasses.replace(runner_config(path, size), kv_offloading_size=0.001)
        runner = ModelRunner(config, progress=False, tp=group)
        found = round_trip(runner, group.is_first)
        if group.is_first:
            results.put((found, runner.num_host_blocks, runner.host_block_bytes))
        if size > 1:  # the ranks leave together (see ranks.run_rank)
            dist.monitored_barrier(group=group.cpu_group, timeout=LEAVE_TIMEOUT)
    finally:
        group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tier") / "qwen3"
    write_checkpoint(path, "qwen3")
    return path


@pytest.mark.parametrize("size", [1, 2])
def test_each_rank_stores_and_loads_its_shard(size: int, checkpoint: Path) -> None:
    (found,) = spawn_ranks(run_rank, size, (checkpoint,), 1, RESULT_TIMEOUT_S)
    (whole, loaded, unfilled), num_host_blocks, host_block_bytes = found
    assert torch.allclose(
        torch.from_numpy(loaded), torch.from_numpy(whole), atol=TOLERANCE, rtol=TOLERANCE
    )
    assert not torch.allclose(
        torch.from_numpy(unfilled), torch.from_numpy(whole), atol=TOLERANCE, rtol=TOLERANCE
    )
    # 0.001 GiB over all ranks: each holds its shard of as many blocks
    single = ModelRunner(runner_config(checkpoint, 1), progress=False)
    assert host_block_bytes == single.bytes_per_block
    assert num_host_blocks == int(0.001 * 2**30) // host_block_bytes
