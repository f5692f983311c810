"""W-nano offline throughput (see docs/benchmarks.md) of the engine, beside its physical floor and
the Hugging Face transformers continuous-batching peer, on the same GPU in the same run.

Weights are random at the real shape (`--load-format dummy` from a written config.json); the
engine, the workload and the floor are `offline_engine.py`'s, the optional probes
`engine_probes.py`'s.

    PYTHONPATH=engine python benchmarks/throughput.py --shape qwen3-0.6b --peer qwen3-0.6b
    PYTHONPATH=engine python benchmarks/throughput.py --shape llama-3.1-8b --itl
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
import triton
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import measure_copy_bandwidth, measure_matmul_rate

from benchmarks.engine_probes import (
    compare_greedy,
    greedy_logprobs,
    host_profile,
    mixed_step_cost,
    print_host_profile,
    profile_decode,
)
from benchmarks.offline_engine import (
    ITL_TOKENS,
    Workload,
    batch1_itl,
    build_engine,
    physical_floor,
    run_engine,
    stop_ranks,
    w_nano,
    write_checkpoint,
)
from benchmarks.shapes import ONE_GPU_SHAPES, SHAPES, kv_bytes_per_token, weight_bytes_per_step

# The long-context latency's prompt: with ITL_TOKENS it stays within W-nano's --max-model-len.
LONG_ITL_PROMPT_TOKENS = 1700


def run_peer(shape: str, work: Workload, time_limit: float) -> dict[str, Any]:
    """HF transformers continuous batching, configured as docs/benchmarks.md says."""
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
        "--host-profile",
        action="store_true",
        help="one more W-nano pass under cProfile: where the loop's thread spends it, by function",
    )
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
            if args.host_profile:
                row["host_profile"] = host_profile(
                    functools.partial(run_engine, engine, work, args.time_limit)
                )
                print_host_profile(row["host_profile"])
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
    parts = ", ".join(f"{part} {ms:.3f}" for part, ms in row["host_ms_per_step"].items())
    print(f"  the loop's thread a step, ms: {parts}")


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
