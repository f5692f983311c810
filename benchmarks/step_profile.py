"""Where a decode step's time goes (docs/benchmarks-archive.md, "where a decode step's time goes"):
W-nano's step intervals by the number of running requests, then the kernels of decode steps at
chosen batch sizes.

With asynchronous scheduling a step's interval (from one `step()` return to the next) is its
device time wherever the device is the bottleneck, so the intervals split W-nano's wall time by
batch without a profiler in the loop. The kernel tables come from decode steps of requests with
`--context`-token prompts: ten steps timed without the profiler (the wall), then five profiled
for their device work only. Each kernel's "effective" time counts from the later of its start
and the previous work's end, so work that overlaps under programmatic dependent launch is
counted once and the column sums to the device's busy time; a busy time equal to the span says
the device, not the host, sets the step.

    PYTHONPATH=engine:. python benchmarks/step_profile.py --shape qwen3-0.6b
    PYTHONPATH=engine:. python benchmarks/step_profile.py --shape llama-3.1-8b --batches 256,64,1
    PYTHONPATH=engine:. python benchmarks/step_profile.py --no-w-nano --batches 1 --context 128
    PYTHONPATH=engine:. python benchmarks/step_profile.py --shape llama-3.1-8b \
        --tensor-parallel-size 2 --batches 256,64,1

Under tensor parallelism the tables are rank 0's, whose runner runs in this process; a
collective's launches then include what rank 0 waited for the others, which its shortest
launch against its median shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_engine import build_engine, run_engine, w_nano, write_checkpoint
from benchmarks.shapes import SHAPES
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine

FIRST_STEPS = 10  # W-nano's prefills: its 256 prompts fill the first ten steps' token budgets
# Running-request bins, largest first: (label, fewest requests in the bin).
BINS = (("193-256", 193), ("129-192", 129), ("65-128", 65), ("17-64", 17), ("2-16", 2), ("1", 1))
TIMED_STEPS = 10
PROFILED_STEPS = 5
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's device events


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


@dataclass(frozen=True)
class DeviceSpan:
    """One kernel, copy or memset on the device's timeline (microseconds)."""

    name: str
    start_us: float
    duration_us: float


def device_spans(trace: dict[str, Any]) -> list[DeviceSpan]:
    """The device's work in a profiler's Chrome trace, in start order."""
    spans = [
        DeviceSpan(str(event["name"]), float(event["ts"]), float(event.get("dur", 0.0)))
        for event in trace.get("traceEvents", [])
        if event.get("cat") in DEVICE_CATEGORIES
    ]
    return sorted(spans, key=lambda span: span.start_us)


def kernel_table(spans: Sequence[DeviceSpan], num_steps: int) -> list[dict[str, Any]]:
    """Per step and kernel name: launches, the kernels' own durations ("us"), and the time
    each added to the timeline ("effective_us": from the later of its start and the previous
    spans' end to its end). A kernel launched early under programmatic dependent launch waits
    inside its duration for the one before it; the effective column counts that wait once,
    so it sums to the device's busy time. Per launch, the shortest and the median duration: a
    collective's shortest launch is about its own cost, its median adds what it waited for
    its peers. Most effective time first."""
    durations: dict[str, list[float]] = defaultdict(list)
    effective: dict[str, float] = defaultdict(float)
    covered_to = float("-inf")
    for span in sorted(spans, key=lambda span: span.start_us):
        end = span.start_us + span.duration_us
        durations[span.name].append(span.duration_us)
        effective[span.name] += max(0.0, end - max(covered_to, span.start_us))
        covered_to = max(covered_to, end)
    rows = [
        {
            "kernel": name,
            "launches": len(own) / num_steps,
            "us": sum(own) / num_steps,
            "effective_us": effective[name] / num_steps,
            "min_us": min(own),
            "median_us": statistics.median(own),
        }
        for name, own in durations.items()
    ]
    return sorted(rows, key=lambda row: -row["effective_us"])


def span_us(spans: Sequence[DeviceSpan]) -> float:
    """From the first span's start to the last one's end."""
    if not spans:
        return 0.0
    return max(s.start_us + s.duration_us for s in spans) - min(s.start_us for s in spans)


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
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        spans = device_spans(json.loads(trace_path.read_text()))
    table = kernel_table(spans, PROFILED_STEPS)
    device_ms = span_us(spans) / PROFILED_STEPS / 1e3
    while engine.has_work():
        engine.step()
    return {
        "batch": batch,
        "context": context,
        "wall_ms": wall_ms,
        "device_span_ms": device_ms,
        "kernels": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="where a decode step's time goes")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks; the kernel tables are rank 0's (its runner runs in this process)",
    )
    parser.add_argument("--batches", default="256,128,64,16,1", help="decode batches to profile")
    parser.add_argument("--context", type=int, default=1000, help="their prompts' tokens")
    parser.add_argument(
        "--w-nano",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time W-nano's steps by bin first (--no-w-nano: the decode tables only)",
    )
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
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}, "
        f"tensor parallel {args.tensor_parallel_size}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_engine(write_checkpoint(args.shape, Path(tmp)), settings)
        seconds, bins = timed_w_nano(engine) if args.w_nano else (0.0, [])
        if args.w_nano:
            print(f"W-nano {seconds:.3f} s, {sum(b.steps for b in bins)} steps")
        for b in bins:
            print(f"  {b.label:>12}: {b.steps:5d} steps {b.seconds:7.3f} s {b.ms_per_step:8.3f} ms")
        profiles = [decode_kernels(engine, int(b), args.context) for b in args.batches.split(",")]
    for profile in profiles:
        kernels = profile["kernels"]
        busy_ms = sum(k["effective_us"] for k in kernels) / 1e3
        print(
            f"decode, batch {profile['batch']}, ~{profile['context']}-token contexts: wall "
            f"{profile['wall_ms']:.3f} ms a step unprofiled; profiled, the device's span "
            f"{profile['device_span_ms']:.3f} ms a step, busy {busy_ms:.3f} ms, "
            f"{sum(k['launches'] for k in kernels):.0f} launches"
        )
        print("  effective us, own us, launches, a launch's shortest and median us, kernel")
        for k in kernels[:16]:
            print(
                f"  {k['effective_us']:9.1f} {k['us']:9.1f} {k['launches']:6.1f}x "
                f"{k['min_us']:7.1f} {k['median_us']:7.1f}  {k['kernel'][:60]}"
            )
    if args.json:
        report = {"w_nano_s": seconds, "bins": [asdict(b) for b in bins], "decode": profiles}
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
