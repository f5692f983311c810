"""Memory safety on the GPU: KV capacity against the budget arithmetic, the W-burst OOM
reproducer, and the W-soak fragmentation series (docs/benchmarks.md).

    PYTHONPATH=engine python benchmarks/memory.py capacity
    PYTHONPATH=engine python benchmarks/memory.py burst --duration 600
    PYTHONPATH=engine python benchmarks/memory.py soak --duration 1800

    PYTHONPATH=engine python benchmarks/memory.py burst --shape llama-3.1-70b \
        --tensor-parallel-size 4 --duration 600

`capacity` builds the runner in-process (one GPU) at --gpu-memory-utilization 0.9 and checks
the KV pool against the arithmetic, then runs the worst-case step on the real pool and checks
that the device's used memory stays within the allowed share. `burst` and `soak` start the
server on a dummy checkpoint of `--shape` (Llama-3.1-8B unless told) and drive it over HTTP
(`memory_load.py`): every request ends as served, rejected (429/503) or lost, the goal for lost
is 0, and each rank's peak device memory is held against its own budget. Results go to stdout
and, as JSON, to --out; the last line says PASS, or FAIL with every goal missed, and a FAIL
exits 1 (`capacity` also fails when the ready runner holds allocations its budget's terms do
not count).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.memory_load import run_server_workload, workload_failures
from benchmarks.shapes import SHAPES

DEFAULT_SHAPE = "llama-3.1-8b"


def write_checkpoint(root: Path, shape: str) -> Path:
    """config.json at `shape` and a word-level tokenizer over its whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    config = SHAPES[shape]
    (root / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    return root


# -- capacity ---------------------------------------------------------------------------------


def run_capacity(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from pagekeeper_engine.config import EngineConfig  # noqa: PLC0415
    from pagekeeper_engine.memory.profile import (  # noqa: PLC0415
        ProfileShapes,
        worst_case_batches,
    )
    from pagekeeper_engine.runner.runner import ModelRunner  # noqa: PLC0415

    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        swap_space=0.0,
    )
    started = time.monotonic()
    runner = ModelRunner(config, progress=False)
    assert runner.memory_budget is not None
    (budget,) = runner.memory_budget.per_rank  # this benchmark runs one GPU
    ideal_kv = budget.allowed - budget.weights - budget.peak_activations - budget.non_torch
    kv_bytes = runner.num_gpu_blocks * runner.bytes_per_block
    torch.cuda.synchronize()
    # once ready, the allocator holds the weights, the KV pool and the activations measured
    held_beyond_terms = (
        torch.cuda.memory_allocated() - budget.weights - kv_bytes - budget.peak_activations
    )
    shapes = ProfileShapes(
        runner.max_num_batched_tokens, args.max_num_seqs, runner.max_model_len, runner.block_size
    )
    torch.cuda.reset_peak_memory_stats()
    # the worst case on the real pool: block ids stay within it
    for batch in worst_case_batches(shapes):
        runner.profile_target.run_profile_batch(batch.seqs, batch.num_sampled_rows)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    peak_used = used - torch.cuda.memory_reserved() + torch.cuda.max_memory_reserved()
    return {
        "terms": budget.terms,
        "num_gpu_blocks": runner.num_gpu_blocks,
        "bytes_per_block": runner.bytes_per_block,
        "kv_bytes": kv_bytes,
        "kv_bytes_arithmetic": budget.kv_cache,
        "kv_vs_arithmetic": kv_bytes / budget.kv_cache,
        "kv_vs_no_buffer": kv_bytes / ideal_kv,
        "device_used_after_worst_step": used,
        "device_peak_used_estimate": peak_used,
        "allowed": budget.allowed,
        "peak_within_allowed": peak_used <= budget.allowed,
        "allocated_beyond_terms_at_ready": held_beyond_terms,
        "startup_seconds": time.monotonic() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["capacity", "burst", "soak"])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.95)
    parser.add_argument("--max-num-batched-tokens", type=int, default=65536)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--swap-space", type=float, default=8.0)
    parser.add_argument("--max-waiting-requests", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        choices=[1, 2, 4, 8],
        default=1,
        help="ranks of the server (burst and soak; capacity runs one GPU)",
    )
    parser.add_argument(
        "--sampling",
        choices=["uniform", "mixed"],
        default="uniform",
        help="uniform: temperature 0.7 for all; mixed: MIXED_SAMPLING's parameter sets",
    )
    parser.add_argument("--sample-every", type=float, default=2.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="memory-benchmark.json")
    args = parser.parse_args()
    if args.mode == "capacity" and args.tensor_parallel_size != 1:
        parser.error("capacity builds one runner on one GPU: --tensor-parallel-size must be 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / args.shape, args.shape)
        if args.mode == "capacity":
            result = run_capacity(args, model_dir)
        else:
            result = run_server_workload(args, model_dir)
    Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=1, default=asdict))
    summary = {k: v for k, v in result.items() if k != "series"}
    print(json.dumps(summary, indent=1))
    failures = capacity_failures(result) if args.mode == "capacity" else workload_failures(result)
    print(f"{args.mode}: " + ("FAIL: " + "; ".join(failures) if failures else "PASS"))
    if failures:
        sys.exit(1)


def capacity_failures(result: dict[str, Any]) -> list[str]:
    """`capacity` fails when the worst-case step took the device past the allowed share, or
    the ready runner held allocations its budget's terms do not count."""
    failures = []
    if not result["peak_within_allowed"]:
        failures.append(
            f"the worst-case step peaked at {result['device_peak_used_estimate']:,} bytes of "
            f"the {result['allowed']:,} allowed"
        )
    if result["allocated_beyond_terms_at_ready"] > 0:
        failures.append(
            f"ready, the allocator held {result['allocated_beyond_terms_at_ready']:,} bytes "
            "beyond the weights, the KV pool and the peak activations"
        )
    return failures


if __name__ == "__main__":
    main()
