"""Where a decode step's time goes (docs/benchmarks.md, run 20): W-nano's step intervals by the
number of running requests, then the kernels of decode steps at chosen batch sizes.

With asynchronous scheduling a step's interval (from one `step()` return to the next) is its
device time wherever the device is the bottleneck, so the intervals split W-nano's wall time by
batch without a profiler in the loop. The kernel tables come from decode steps of requests with
`--context`-token prompts: ten steps timed without the profiler (the wall), then five profiled
for their CUDA kernels only (the sum of kernel times, by kernel).

    PYTHONPATH=engine:. python benchmarks/step_profile.py --shape qwen3-0.6b
    PYTHONPATH=engine:. python benchmarks/step_profile.py --shape llama-3.1-8b --batches 256,64,1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.shapes import SHAPES
from benchmarks.throughput import build_engine, run_engine, w_nano, write_checkpoint
from pagekeeper_engine.core.engine import LLMEngine
from pagekeeper_engine.core.sampling import SamplingParams

FIRST_STEPS = 10  # W-nano's prefills: its 256 prompts fill the first ten steps' token budgets
# Running-request bins, largest first: (label, fewest requests in the bin).
BINS = (("193-256", 193), ("129-192", 129), ("65-128", 65), ("17-64", 17), ("2-16", 2), ("1", 1))
TIMED_STEPS = 10
PROFILED_STEPS = 5


@dataclass(frozen=True)
class StepStamp:
    """When a step returned, and how many requests were running when it was scheduled."""

    ended_s: float
    running: int


@dataclass(frozen=True)
class BinTotal:
    label: str
    steps: int
    seconds: float

    @property
    def ms_per_step(self) -> float:
        return self.seconds / self.steps * 1e3


def bin_steps(started_s: float, stamps: Iterable[StepStamp]) -> list[BinTotal]:
    """Each step's interval (from the previous step's return, the first from `started_s`) summed
    by bin: the first FIRST_STEPS steps, then by the requests running when each was scheduled.
    Empty bins are left out."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    previous = started_s
    for index, stamp in enumerate(stamps):
        label = "first steps" if index < FIRST_STEPS else _bin_of(stamp.running)
        totals[label][0] += 1
        totals[label][1] += stamp.ended_s - previous
        previous = stamp.ended_s
    order = ["first steps", *(label for label, _ in BINS), "idle"]
    return [BinTotal(k, int(totals[k][0]), totals[k][1]) for k in order if k in totals]


def _bin_of(running: int) -> str:
    for label, fewest in BINS:
        if running >= fewest:
            return label
    return "idle"


def kernel_table(kernels: Iterable[tuple[str, float]], num_steps: int) -> list[dict[str, Any]]:
    """(name, device us) of every kernel a profile saw over `num_steps` steps -> per step: each
    name's launches and microseconds, most time first."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, micros in kernels:
        by_name[name][0] += 1
        by_name[name][1] += micros
    rows = [
        {"kernel": name, "launches": count / num_steps, "us": micros / num_steps}
        for name, (count, micros) in by_name.items()
    ]
    return sorted(rows, key=lambda row: -row["us"])


def timed_w_nano(engine: LLMEngine) -> tuple[float, list[BinTotal]]:
    work = w_nano()
    run_engine(engine, work, time_limit=300.0)  # a whole untimed pass first, as throughput.py
    for i, (prompt, output_len) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        params = SamplingParams(max_tokens=output_len, temperature=0.6, ignore_eos=True)
        engine.add_request(f"req-{i}", prompt, params)
    torch.cuda.synchronize()
    stamps = []
    started = time.perf_counter()
    while engine.has_work():
        # The scheduler's list, not `stats()`: a whole snapshot a step would add host work to
        # the steps being timed.
        running = len(engine.scheduler.running)
        engine.step()
        stamps.append(StepStamp(time.perf_counter(), running))
    torch.cuda.synchronize()
    return time.perf_counter() - started, bin_steps(started, stamps)


def decode_kernels(engine: LLMEngine, batch: int, context: int) -> dict[str, Any]:
    """Wall and kernels of decode steps of `batch` requests with `context`-token prompts."""
    for i in range(batch):
        prompt = [(7 * i + j) % 10000 for j in range(context)]
        params = SamplingParams(max_tokens=60, temperature=0.6, ignore_eos=True)
        engine.add_request(f"prof-{batch}-{i}", prompt, params)
    for _ in range(40 if batch > 64 else 12):  # past the prefills
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / TIMED_STEPS * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    table = kernel_table(
        ((e.name, e.device_time_total) for e in prof.events() if e.device_type.name == "CUDA"),
        PROFILED_STEPS,
    )
    while engine.has_work():
        engine.step()
    return {"batch": batch, "context": context, "wall_ms": wall_ms, "kernels": table}


def main() -> None:
    parser = argparse.ArgumentParser(description="where a decode step's time goes")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--batches", default="256,128,64,16,1", help="decode batches to profile")
    parser.add_argument("--context", type=int, default=1000, help="their prompts' tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    settings = argparse.Namespace(  # W-nano's, as throughput.py's defaults
        max_num_seqs=256,
        block_size=16,
        max_num_batched_tokens=16384,
        gpu_memory_utilization=0.9,
        enforce_eager=False,
        async_scheduling=True,
        safety="on",
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=1,
    )
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}")
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_engine(write_checkpoint(args.shape, Path(tmp)), settings)
        seconds, bins = timed_w_nano(engine)
        print(f"W-nano {seconds:.3f} s, {sum(b.steps for b in bins)} steps")
        for b in bins:
            print(f"  {b.label:>12}: {b.steps:5d} steps {b.seconds:7.3f} s {b.ms_per_step:8.3f} ms")
        profiles = [decode_kernels(engine, int(b), args.context) for b in args.batches.split(",")]
    for profile in profiles:
        kernels = profile["kernels"]
        print(
            f"decode, batch {profile['batch']}, ~{profile['context']}-token contexts: wall "
            f"{profile['wall_ms']:.3f} ms a step, kernels {sum(k['us'] for k in kernels) / 1e3:.3f}"
            f" ms, {sum(k['launches'] for k in kernels):.0f} launches"
        )
        for k in kernels[:16]:
            print(f"  {k['us']:9.1f} us {k['launches']:6.1f}x  {k['kernel'][:70]}")
    if args.json:
        report = {"w_nano_s": seconds, "bins": [asdict(b) for b in bins], "decode": profiles}
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
