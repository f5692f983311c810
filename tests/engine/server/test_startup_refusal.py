"""A KV cache that cannot hold one max-model-len request: the server refuses to start, says why
in its log and in the termination message the operator reads, and exits 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.processes import engine_pythonpath, free_port
from tests.engine.server.conftest import Checkpoint


def test_server_refuses_a_budget_that_cannot_hold_one_request(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    termination_log = tmp_path / "termination-log"
    argv = [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(checkpoint.path),
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
        "--port", str(free_port()), "--block-size", "8", "--max-model-len", "64",
        "--num-gpu-blocks-override", "8", "--num-cpu-blocks-override", "0",
        "--termination-log-path", str(termination_log),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = engine_pythonpath()
    env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    reason = (
        "--num-gpu-blocks-override 8 leaves 7 usable blocks of 8 tokens; "
        "one --max-model-len 64 request needs 8"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert termination_log.read_text() == (
        f"pagekeeper-oom kind=host phase=startup detail={reason}\n"
    )
    assert f"exiting: out of memory at startup: {reason}" in result.stderr
    assert "CUDA caching allocator: PYTORCH_ALLOC_CONF=expandable_segments:True" in result.stderr


def test_server_refuses_a_model_that_does_not_split_over_the_ranks(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The tiny model has 4 attention heads: 8 ranks cannot share them."""
    argv = [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(checkpoint.path),
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
        "--port", str(free_port()), "--tensor-parallel-size", "8",
        "--termination-log-path", str(tmp_path / "termination-log"),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = engine_pythonpath()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        "--tensor-parallel-size 8: 4 attention heads do not split evenly over 8 ranks"
        in result.stderr
    ), result.stderr[-3000:]
    assert not (tmp_path / "termination-log").exists()  # not a memory failure


def test_every_rank_refuses_the_same_budget_and_the_server_exits_1(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Under tensor parallelism each rank sizes its own shard; a budget that cannot hold one
    request refuses on every rank, and the engine still exits at once with the reason."""
    termination_log = tmp_path / "termination-log"
    argv = [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(checkpoint.path),
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
        "--port", str(free_port()), "--block-size", "8", "--max-model-len", "64",
        "--num-gpu-blocks-override", "8", "--num-cpu-blocks-override", "0",
        "--tensor-parallel-size", "2", "--termination-log-path", str(termination_log),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = engine_pythonpath()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert termination_log.read_text().startswith(
        "pagekeeper-oom kind=host phase=startup detail=--num-gpu-blocks-override 8 leaves 7"
    )
