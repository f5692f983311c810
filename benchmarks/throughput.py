"""W-nano offline throughput (see BENCHMARKS.md) of the engine, beside its physical floor and
the Hugging Face transformers continuous-batching peer, on the same GPU in the same run.

Weights are random at the real shape (`--load-format dummy` from a written config.json). The
floor is (weight bytes read per decode step x steps + KV bytes read) / measured copy bandwidth
+ prefill FLOPs / measured bf16 matmul rate.

    PYTHONPATH=engine python benchmarks/throughput.py --shape qwen3-0.6b --peer qwen3-0.6b
    PYTHONPATH=engine python benchmarks/throughput.py --shape llama-3.1-8b --itl
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
import triton
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import measure_copy_bandwidth, measure_matmul_rate

from benchmarks.shapes import ONE_GPU_SHAPES, SHAPES, prefill_flops, weight_bytes_per_step
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.engine import LLMEngine
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.executor.workers import WorkerRanks, start_tensor_parallel
from pagekeeper_engine.faults import RankFailedError
from pagekeeper_engine.heap import freeze_startup_heap, thaw_heap
from pagekeeper_engine.runner.runner import ModelRunner

ITL_TOKENS = 256  # tokens a batch-1 latency request generates
# The long-context latency's prompt: with ITL_TOKENS it stays within W-nano's --max-model-len.
LONG_ITL_PROMPT_TOKENS = 1700


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def w_nano(num_requests: int = 256) -> Workload:
    """256 random prompts of 100..1024 tokens, outputs of 100..1024, as BENCHMARKS.md draws them."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [random.randint(100, 1024) for _ in range(num_requests)])


def physical_floor(
    cfg: dict[str, Any],
    work: Workload,
    bandwidth: float,
    rate: float,
    kv_element_bytes: int = 2,  # the KV cache dtype's itemsize (1 for FP8)
    tensor_parallel_size: int = 1,
) -> float:
    """Seconds: every request runs concurrently, so there are max(output_lens) decode steps.
    Under tensor parallelism, one rank's share: the weights and FLOPs over N, the KV heads
    over N (at least one a rank); the all-reduces between the ranks are not counted here
    (`allreduce.py` measures them, and docs/benchmarks.md adds them)."""
    tp = tensor_parallel_size
    kv_per_token = kv_bytes_per_token(cfg, kv_element_bytes, tp)
    kv_reads = sum(  # decode step i of a request reads its prompt + i cached tokens
        n * len(p) + n * (n - 1) // 2 for p, n in zip(work.prompts, work.output_lens, strict=True)
    )
    weight_bytes = weight_bytes_per_step(cfg) / tp * max(work.output_lens)
    prefill = prefill_flops(cfg, (len(p) for p in work.prompts)) / tp
    return float((weight_bytes + kv_reads * kv_per_token) / bandwidth + prefill / rate)


def kv_bytes_per_token(
    cfg: dict[str, Any], kv_element_bytes: int = 2, tensor_parallel_size: int = 1
) -> int:
    """One token's keys and values in every layer, on one rank (its KV heads, at least one)."""
    kv_heads = -(-cfg["num_key_value_heads"] // tensor_parallel_size)
    return 2 * cfg["num_hidden_layers"] * kv_heads * cfg["head_dim"] * kv_element_bytes


def write_checkpoint(shape: str, root: Path) -> Path:
    model_dir = root / shape
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    return model_dir


def build_engine(
    model_dir: Path, args: argparse.Namespace, **settings: Any
) -> tuple[LLMEngine, dict[str, Any]]:
    """The engine, and how long its start took (CUDA-graph capture included). W-nano's settings
    unless `settings` (EngineConfig fields) say otherwise."""
    started = time.perf_counter()
    w_nano = {
        "model": str(model_dir),
        "load_format": "dummy",
        "device": "cuda",
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "max_num_seqs": args.max_num_seqs,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "swap_space": 0.0,
        "enable_prefix_caching": False,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "fragmentation_buffer": "auto" if args.safety == "on" else 0,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
    }
    config = EngineConfig(**{**w_nano, **settings})
    stop_ranks()
    if config.tensor_parallel_size > 1:
        directory = tempfile.mkdtemp(prefix="tp-bench-")
        runner, workers = start_tensor_parallel(config, directory, end_on_rank_failure)
        _RANKS.append(workers)
    else:
        runner = ModelRunner(config, progress=False)
    if args.safety == "off":
        # The memory-safety features a bare engine lacks: the allocator statistics the step
        # loop reads, and the static workspace (eager steps allocate their temporaries per call
        # again; the decode graphs keep the addresses they were captured with). Admission and
        # the OOM guard stay: they are the scheduler's arithmetic and a try block.
        runner.allocator_monitor = None
        runner.model.bind_workspace(None)
    start = {
        "startup_s": time.perf_counter() - started,
        "cuda_graphs": runner.graphs is not None,
        "graph_capture_s": 0.0 if runner.graphs is None else runner.graphs.capture_seconds,
        "graph_pool_mib": 0.0 if runner.graphs is None else runner.graphs.pool_bytes / 2**20,
        "num_gpu_blocks": runner.num_gpu_blocks,
        "kv_cache_element_bytes": runner.kv_cache_dtype.itemsize,
        "async_scheduling": args.async_scheduling,
        "safety": args.safety,
        "batch1_projections": [choice.describe() for choice in runner.gemv_choices],
        "batch1_layer": (
            runner.fusion_choice.describe() if runner.fusion_choice is not None else None
        ),
        "all_reduce": runner.all_reduce_choice.describe(),
    }
    print(
        f"  start-up {start['startup_s']:.1f} s ({runner.num_gpu_blocks} KV blocks); CUDA graphs "
        + (
            f"{len(runner.graphs.batch_sizes)} decode sizes and "
            f"{len(runner.graphs.piecewise.token_sizes)} mixed-step sizes "
            f"({runner.graphs.piecewise.num_graphs} pieces) captured in "
            f"{start['graph_capture_s']:.1f} s, "
            f"{start['graph_pool_mib']:.0f} MiB"
            if runner.graphs is not None
            else "off (--enforce-eager)"
        )
    )
    for line in start["batch1_projections"]:
        print(f"  batch-1 {line}")
    if start["batch1_layer"] is not None:
        print(f"  batch-1 {start['batch1_layer']}")
    if args.tensor_parallel_size > 1:
        print(f"  all-reduce: {start['all_reduce']}")
    engine = LLMEngine(config, runner, runner.eos_token_ids)
    freeze_startup_heap("the benchmark's engine")  # as the engine core's process does
    return engine, start


_RANKS: list[WorkerRanks] = []  # the other ranks of the engine built last


def end_on_rank_failure(failure: RankFailedError) -> None:
    """A worker rank died: the run's figures are void, and rank 0 may wait for good inside a
    collective that rank never joins, so the benchmark ends here (on the watchdog's thread)."""
    print(f"  {failure}; the benchmark stops", file=sys.stderr, flush=True)
    os._exit(1)


def stop_ranks() -> None:
    """Stop the previous engine's worker ranks, so the next engine has their GPUs."""
    while _RANKS:
        _RANKS.pop().stop()
    thaw_heap()  # the dropped engine's cycles are collected only once they are not frozen
    gc.collect()
    torch.cuda.empty_cache()


def run_engine(engine: LLMEngine, work: Workload, time_limit: float) -> dict[str, Any]:
    params = [
        SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True) for n in work.output_lens
    ]
    # Warm-up: the whole workload once, untimed, so the timed run meets no kernel
    # specialisation it has not compiled. Triton specialises integer arguments (== 1, % 16),
    # and the mixed steps of a full run meet specialisations that a short warm-up does not: in
    # a fresh process with an empty Triton cache they compiled inside the timed run and cost
    # Qwen3 2.3 s of 8.5 s (runs 1-8 below were measured that way).
    for i, (prompt, sampling) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(f"warm-{i}", prompt, sampling)
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    steps_before, waited_before = engine.num_steps, engine.device_wait_seconds
    start = time.perf_counter()
    for i, (prompt, sampling) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(f"req-{i}", prompt, sampling)
    num_output = num_finished = 0
    unfinished = {f"req-{i}" for i in range(len(work.prompts))}
    while engine.has_work() and time.perf_counter() - start < time_limit:
        for out in engine.step():
            num_output += len(out.new_token_ids)
            num_finished += out.finished
            if out.finished:
                unfinished.discard(out.request_id)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    num_steps = engine.num_steps - steps_before
    device_wait_s = engine.device_wait_seconds - waited_before
    # Past the time limit: end what is left, so later measurements (batch-1 latency) find the
    # engine idle instead of sharing every step with the rest of W-nano.
    for request_id in unfinished:
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    return {
        "seconds": seconds,
        "num_output_tokens": num_output,
        "num_finished": num_finished,
        "complete": num_finished == len(work.prompts),
        "num_steps": num_steps,
        # the host idle, waiting for the device: near 0, the host set the pace
        "device_wait_s": device_wait_s,
    }


def batch1_itl(engine: LLMEngine, num_tokens: int = ITL_TOKENS, prompt_tokens: int = 128) -> float:
    """Median seconds between consecutive tokens of a lone request after a prompt of
    `prompt_tokens`."""
    assert not engine.has_work(), "batch-1 latency needs an idle engine"
    prompt = list(range(1000, 1000 + prompt_tokens))
    engine.add_request("itl", prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    stamps = []
    # A token reaches the host only once the device has sampled it; no extra synchronisation
    # (it would stall the step an overlapped loop has already launched).
    while engine.has_work():
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps[1:]))
    return gaps[len(gaps) // 2]


def profile_decode(engine: LLMEngine, batch: int, path: str | None) -> None:
    """Print where a decode step of `batch` running requests spends host and device time."""
    for i in range(batch):
        prompt = [(7 * i + j) % 10000 for j in range(512)]
        engine.add_request(f"prof-{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):  # past the prefills: every request decodes from here on
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    if path:
        prof.export_chrome_trace(path)
    while engine.has_work():
        engine.step()


def mixed_step_cost(engine: LLMEngine, batch: int, prompt_len: int) -> dict[str, float]:
    """Host and wall time of one mixed step (a `prompt_len`-token prefill beside `batch`
    decodes) against a decode-only step of the same batch, and the kernels each launches.

    Times are medians of 5 steps timed without a profiler (host: until `step` returns with the
    step enqueued; wall: until the device has run it); a sixth step of each kind runs under
    torch.profiler for its kernel count only, since the profiler's own host overhead is several
    times a step's."""
    for i in range(batch):
        prompt = [(7 * i + j) % 10000 for j in range(512)]
        engine.add_request(f"mix-{i}", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(8):  # past the prefills: every request decodes from here on
        engine.step()
    costs: dict[str, float] = {}
    for kind in ("decode", "mixed"):
        host, wall = [], []
        for round_ in range(6):
            if kind == "mixed":
                prompt = [(11 * j + round_) % 10000 for j in range(prompt_len)]
                engine.add_request(f"mix-prefill-{round_}", prompt, SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
            if round_ == 5:
                activities = [
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
                with torch.profiler.profile(activities=activities) as prof:
                    engine.step()
                    torch.cuda.synchronize()
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                costs[f"{kind}_kernels"] = len(kernels)
            else:
                started = time.perf_counter()
                engine.step()
                host.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                wall.append(time.perf_counter() - started)
            engine.step()  # the step's tokens come back; a prefill request ends here
        costs[f"{kind}_host_ms"] = statistics.median(host) * 1e3
        costs[f"{kind}_wall_ms"] = statistics.median(wall) * 1e3
    print(
        f"  mixed step ({prompt_len}-token prefill + {batch} decodes): "
        f"{costs['mixed_kernels']:.0f} kernels, host {costs['mixed_host_ms']:.2f} ms, "
        f"wall {costs['mixed_wall_ms']:.2f} ms; decode-only: {costs['decode_kernels']:.0f} "
        f"kernels, host {costs['decode_host_ms']:.2f} ms, wall {costs['decode_wall_ms']:.2f} ms"
    )
    while engine.has_work():
        engine.step()
    return costs


def greedy_logprobs(
    engine: LLMEngine, num_prompts: int, num_steps: int, prompt_len: int = 512
) -> dict[str, list[tuple[int, float]]]:
    """(token, log-probability) of `num_steps` greedy tokens for each of `num_prompts` seeded
    prompts of `prompt_len` random ids."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True, logprobs=True)
    for i in range(num_prompts):
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
        engine.add_request(f"acc-{i}", prompt, params)
    picked: dict[str, list[tuple[int, float]]] = {}
    while engine.has_work():
        for out in engine.step():
            for token, logprob in zip(out.new_token_ids, out.logprobs, strict=True):
                assert logprob is not None
                picked.setdefault(out.request_id, []).append((token, logprob))
    return picked


def compare_greedy(
    reference: dict[str, list[tuple[int, float]]], other: dict[str, list[tuple[int, float]]]
) -> dict[str, float]:
    """Share of identical greedy tokens over every position, and the absolute difference of the
    chosen token's log-probability over the positions up to each prompt's first divergence
    (after it the two runs continue different texts)."""
    num_same = num_all = 0
    diffs: list[float] = []
    for request_id, ref in reference.items():
        mine = other[request_id]
        diverged = False
        for (ref_token, ref_lp), (token, lp) in zip(ref, mine, strict=True):
            num_all += 1
            num_same += token == ref_token
            if not diverged:
                diffs.append(abs(lp - ref_lp))
                diverged = token != ref_token
    return {
        "identical_token_share": num_same / num_all,
        "logprob_abs_diff_mean": sum(diffs) / len(diffs),
        "logprob_abs_diff_max": max(diffs),
        "num_positions": num_all,
        "num_compared_logprobs": len(diffs),
    }


def run_peer(shape: str, work: Workload, time_limit: float) -> dict[str, Any]:
    """HF transformers continuous batching, configured as BENCHMARKS.md prescribes."""
    cfg = AutoConfig.for_model(**SHAPES[shape])
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        cfg, dtype=torch.bfloat16
    )
    model = model.cuda().eval()
    cb_config = transformers.ContinuousBatchingConfig(
        max_memory_percent=0.9, max_batch_tokens=8192, use_cuda_graph=True
    )
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=1024, eos_token_id=-1, do_sample=False
        ),
        continuous_batching_config=cb_config,
    )
    manager.start()
    try:
        for i in range(2):
            manager.add_request(work.prompts[i][:200], request_id=f"warm-{i}", max_new_tokens=8)
        for _ in range(2):
            manager.get_result(timeout=600)
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"req-{i}", max_new_tokens=n)
        num_output = num_finished = 0
        while num_finished < len(work.prompts) and time.perf_counter() - start < time_limit:
            result = manager.get_result(timeout=1.0)
            if result is not None and result.is_finished():
                num_finished += 1
                num_output += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=False)
    del model, manager
    return {
        "seconds": seconds,
        "num_output_tokens": num_output,
        "num_finished": num_finished,
        "complete": num_finished == len(work.prompts),
        "transformers": transformers.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="W-nano throughput against floor and peer")
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="qwen3-0.6b")
    parser.add_argument(
        "--peer",
        nargs="*",
        choices=list(SHAPES),
        default=[],
        help="shapes to also run through the transformers continuous-batching peer",
    )
    parser.add_argument("--peer-time-limit", type=float, default=300.0)
    parser.add_argument(
        "--itl",
        action="store_true",
        help="batch-1 inter-token latency too, after a 128-token and a 1,700-token prompt",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap the host's step work with the device's (--no-async-scheduling: serial)",
    )
    parser.add_argument(
        "--safety",
        choices=["on", "off"],
        default="on",
        help="off: no fragmentation buffer, no allocator statistics, no static workspace",
    )
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--profile", action="store_true", help="profile 10 decode steps")
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="time one step of this many prefill tokens beside"
        " --max-num-seqs / 2 decodes, against a decode-only step (kernels, host and wall time)",
    )
    parser.add_argument("--trace", default=None, help="write the profile's Chrome trace here")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, choices=[1, 2, 4, 8], default=1)
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="greedy steps against the reference engine: 32 prompts x 128 steps with this "
        "--kv-cache-dtype against auto (bf16), or 32 x 64 with this --tensor-parallel-size "
        "against 1",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    work = w_nano()
    bandwidth, rate = measure_copy_bandwidth(), measure_matmul_rate()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}; copy {bandwidth / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} "
        f"TFLOP/s; W-nano {work.num_prompt_tokens} prompt + {work.num_output_tokens} output"
    )
    shapes = list(ONE_GPU_SHAPES) if args.shape == "all" else [args.shape]
    report: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            engine, start = build_engine(write_checkpoint(shape, Path(tmp)), args)
            floor = physical_floor(
                SHAPES[shape],
                work,
                bandwidth,
                rate,
                start["kv_cache_element_bytes"],
                args.tensor_parallel_size,
            )
            row = {
                "shape": shape,
                "tensor_parallel_size": args.tensor_parallel_size,
                "floor_s": floor,
                **start,
                **run_engine(engine, work, args.time_limit),
            }
            print_row(row, work)
            if args.itl:
                tp = args.tensor_parallel_size
                row["itl_s"] = batch1_itl(engine)
                row["itl_floor_s"] = weight_bytes_per_step(SHAPES[shape]) / tp / bandwidth
                # After a long prompt a step also reads its context's KV (its mean over the run).
                row["itl_long_s"] = batch1_itl(engine, prompt_tokens=LONG_ITL_PROMPT_TOKENS)
                kv_bytes = (LONG_ITL_PROMPT_TOKENS + ITL_TOKENS // 2) * kv_bytes_per_token(
                    SHAPES[shape], start["kv_cache_element_bytes"], tp
                )
                row["itl_long_floor_s"] = row["itl_floor_s"] + kv_bytes / bandwidth
                print_itl(row)
            if args.profile:
                profile_decode(engine, args.max_num_seqs, args.trace)
            if args.mixed:
                row["mixed_step"] = mixed_step_cost(engine, args.max_num_seqs // 2, args.mixed)
            if args.accuracy:
                num_steps = 64 if args.tensor_parallel_size > 1 else 128
                mine = greedy_logprobs(engine, 32, num_steps)
                del engine
                stop_ranks()
                reference = {"kv_cache_dtype": "auto", "tensor_parallel_size": 1}
                reference_args = argparse.Namespace(**{**vars(args), **reference})
                engine, _ = build_engine(write_checkpoint(shape, Path(tmp)), reference_args)
                row["accuracy"] = compare_greedy(greedy_logprobs(engine, 32, num_steps), mine)
                print(
                    f"  {args.kv_cache_dtype} KV, TP {args.tensor_parallel_size} against bf16 "
                    f"KV, TP 1: {row['accuracy']}"
                )
            report.append(row)
            del engine
            stop_ranks()
    # The peer runs last, so a slow peer cannot cost the engine's own results.
    for row in report:
        if row["shape"] in args.peer:
            try:
                row["peer"] = run_peer(row["shape"], work, args.peer_time_limit)
            except Exception as exc:  # the peer's failure is a result to record, not a crash
                row["peer"] = {"error": f"{type(exc).__name__}: {exc}"}
            print_peer(row)
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def print_row(row: dict[str, Any], work: Workload) -> None:
    total = work.num_prompt_tokens + row["num_output_tokens"]
    out_rate = row["num_output_tokens"] / row["seconds"]
    status = "" if row["complete"] else f" (INCOMPLETE: {row['num_finished']} finished)"
    print(
        f"{row['shape']}: {row['seconds']:.2f} s{status}, {out_rate:,.0f} output tok/s, "
        f"{total / row['seconds']:,.0f} total tok/s, floor {row['floor_s']:.2f} s{_per_rank(row)} "
        f"-> {row['floor_s'] / row['seconds']:.0%} of the floor, {row['num_steps']} steps, "
        f"async scheduling {'on' if row['async_scheduling'] else 'off'}"
        + (
            f", the host waited {row['device_wait_s']:.2f} s for the device"
            if row["async_scheduling"]
            else ""
        )
    )


def print_itl(row: dict[str, Any]) -> None:
    short, long = row["itl_s"], row["itl_long_s"]
    floor, long_floor = row["itl_floor_s"], row["itl_long_floor_s"]
    print(
        f"  batch-1 inter-token latency {short * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms"
        f"{_per_rank(row)} ({short / floor:.2f}x); after a {LONG_ITL_PROMPT_TOKENS:,}-token "
        f"prompt {long * 1e3:.2f} ms, floor with its KV reads {long_floor * 1e3:.2f} ms "
        f"({long / long_floor:.2f}x)"
    )


def _per_rank(row: dict[str, Any]) -> str:
    """What a floor leaves out under tensor parallelism."""
    if row["tensor_parallel_size"] == 1:
        return ""
    return " (one rank's bytes and FLOPs; the all-reduces not counted)"


def print_peer(row: dict[str, Any]) -> None:
    peer = row["peer"]
    if "error" in peer:
        print(f"  {row['shape']} peer failed: {peer['error']}")
        return
    out_rate = row["num_output_tokens"] / row["seconds"]
    peer_rate = peer["num_output_tokens"] / peer["seconds"]
    done = "" if peer["complete"] else f" (INCOMPLETE: {peer['num_finished']} finished)"
    print(
        f"  {row['shape']} peer transformers {peer['transformers']}: {peer['seconds']:.1f} s"
        f"{done}, {peer_rate:,.0f} output tok/s; engine / peer = {out_rate / peer_rate:.1f}x"
    )


if __name__ == "__main__":
    main()
