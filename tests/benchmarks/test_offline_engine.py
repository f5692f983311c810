"""The offline engine of the benchmarks (`benchmarks/offline_engine.py`) as `serving.py` builds
it, with the server's settings instead of W-nano's: a closed-loop level runs to its last token
on the CPU, on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

from benchmarks import serving
from benchmarks import serving_workload as wl
from harness.cpu_engine import VOCAB, write_tiny_checkpoint
from pagekeeper_engine.heap import thaw_heap


def test_serving_runs_a_closed_loop_level_through_the_offline_engine(tmp_path: Path) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    settings = wl.EngineSettings(
        device="cpu",
        dtype="float32",
        max_model_len=240,
        max_num_seqs=4,
        block_size=8,
        max_num_batched_tokens=None,
        gpu_memory_utilization=0.9,
        enable_prefix_caching=True,
        enforce_eager=True,
    )
    level = wl.Level(concurrency=2)
    lengths = {"vocab_size": len(VOCAB), "prompt_lens": (8, 40), "output_lens": (3, 9)}
    work, warm = wl.level_workloads(level, 0, 5, **lengths)
    try:
        env, results = serving.run_offline(model_dir, settings, [(level, (work, warm))])
    finally:
        thaw_heap()  # the engine froze the start-up heap, as in a benchmark's own process
    (result,) = results
    assert result["num_finished"] == 5
    assert result["num_failed"] == 0
    assert result["num_output_tokens"] == sum(work.output_lens)
    assert env["num_gpu_blocks"] > 0
    assert "gpu" not in env  # a CPU engine names no device
