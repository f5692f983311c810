"""The engine offline under W-nano (docs/benchmarks.md): the workload, its physical floor, the
engine built at W-nano's settings from a written checkpoint (random weights at the real shape), one
timed pass, and a lone request's inter-token latency. `throughput.py` reports them; the other
benchmarks and the GPU tests build on them.

The floor is (weight bytes read per decode step x steps + KV bytes read) / measured copy
bandwidth + prefill FLOPs / measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.shapes import SHAPES, kv_bytes_per_token, prefill_flops, weight_bytes_per_step
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.executor.workers import WorkerRanks, start_tensor_parallel
from pagekeeper_engine.faults import RankFailedError
from pagekeeper_engine.heap import freeze_startup_heap, thaw_heap
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.runner.runner import ModelRunner

ITL_TOKENS = 256  # tokens a batch-1 latency request generates


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
    """256 random prompts of 100..1024 tokens, outputs of 100..1024, as docs/benchmarks.md draws
    them."""
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
    if config.tensor_parallel_size > 1:
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
    # Qwen3 2.3 s of 8.5 s.
    for i, (prompt, sampling) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(f"warm-{i}", prompt, sampling)
    while engine.has_work():
        engine.step()
    synchronize()
    steps_before, spent_before = engine.num_steps, engine.host_seconds.copy()
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
    synchronize()
    seconds = time.perf_counter() - start
    num_steps = engine.num_steps - steps_before
    spent = engine.host_seconds.since(spent_before)
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
        "device_wait_s": spent.wait,
        # the loop's thread by part of its steps (`loop.step_time`), ms a step
        "host_ms_per_step": {
            part: seconds / max(num_steps, 1) * 1e3 for part, seconds in spent.as_dict().items()
        },
    }


def synchronize() -> None:
    """Wait for the GPU's queued work; nothing to wait for on the CPU (the smoke tests)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
