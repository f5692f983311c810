"""Weight memory as policy, measured in one unattended process (issue 50): FP8 weights against
bf16, CPU weight offload at a utilization where the model cannot otherwise start, and the KV
bytes `--kv-cache-memory-bytes` asked for against those allocated.

Weights are random at the real shape (`--load-format dummy`); the engine, W-nano and its floor
are `offline_engine.py`'s, the greedy comparison `engine_probes.py`'s.

    PYTHONPATH=engine:. python benchmarks/weights.py --shape llama-3.1-8b --out weights.json

Sections (each engine built, measured and dropped before the next):
1. bf16, then `--quantization fp8`: W-nano output tok/s (and the ratio), batch-1 ITL, the
   start-up budget's weights term, greedy agreement and the mean log-probability difference.
2. `--cpu-offload-gb` at a utilization chosen so that without it one max-model-len request does
   not fit (computed from the bf16 budget): the refusal, then the offloaded start, its W-nano
   subset and ITL beside the resident bf16 engine's on the same subset. Every offloaded step
   copies the offloaded bytes over the host link (~0.17 s for 8 GiB), so the subset (the first
   `--offload-requests` W-nano requests, outputs capped at `--offload-max-output`) keeps the
   section to minutes; `--offload-requests 256 --offload-max-output 1024` is W-nano itself.
3. `--kv-cache-memory-bytes`: the request against the pool allocated (blocks x bytes a block).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_probes import compare_greedy, greedy_logprobs
from benchmarks.kernels import measure_copy_bandwidth, measure_matmul_rate
from benchmarks.offline_engine import (
    Workload,
    batch1_itl,
    build_engine,
    physical_floor,
    run_engine,
    stop_ranks,
    w_nano,
    write_checkpoint,
)
from benchmarks.shapes import SHAPES
from pagekeeper_engine.flags import parse_bytes
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.memory.budget import MemoryBudgetError
from pagekeeper_engine.model.offload_plan import linear_params_per_layer, plan_offload
from pagekeeper_engine.runner.runner import ModelRunner

GiB = 1 << 30


def start_engine(
    model_dir: Path, args: argparse.Namespace, **settings: Any
) -> tuple[LLMEngine, dict[str, Any]]:
    """`build_engine` on --device in --dtype, with `settings` (EngineConfig fields)."""
    return build_engine(model_dir, args, device=args.device, dtype=args.dtype, **settings)


def runner_of(engine: LLMEngine) -> ModelRunner:
    assert isinstance(engine.runner, ModelRunner), "one process: the runner is rank 0's own"
    return engine.runner


def budget_terms(engine: LLMEngine) -> dict[str, int] | None:
    """Rank 0's start-up budget (None on the CPU, which has none)."""
    budget = runner_of(engine).memory_budget
    return None if budget is None else dict(budget.per_rank[0].terms)


def measure(
    engine: LLMEngine, args: argparse.Namespace, work: Workload, itl_tokens: int
) -> dict[str, Any]:
    run = run_engine(engine, work, args.time_limit)
    return {
        **run,
        "output_tok_s": run["num_output_tokens"] / run["seconds"],
        "itl_s": batch1_itl(engine, num_tokens=itl_tokens),
        "budget": budget_terms(engine),
    }


def weights_section(model_dir: Path, args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    picked: dict[str, dict[str, list[tuple[int, float]]]] = {}
    variants = (("bf16", "none"), ("fp8", "fp8")) if not args.fp8_only else (("fp8", "fp8"),)
    for name, quantization in variants:
        print(f"## weights {name}")
        engine, start = start_engine(model_dir, args, quantization=quantization)
        rows[name] = {**start, **measure(engine, args, work, args.itl_tokens)}
        picked[name] = greedy_logprobs(
            engine, args.accuracy_prompts, args.accuracy_steps, args.accuracy_prompt_len
        )
        del engine
        stop_ranks()
    if args.fp8_only:
        return rows
    bf16, fp8 = rows["bf16"], rows["fp8"]
    section: dict[str, Any] = {
        **rows,
        "throughput_ratio": fp8["output_tok_s"] / bf16["output_tok_s"],
        "itl_ratio": fp8["itl_s"] / bf16["itl_s"],
        "accuracy": compare_greedy(picked["bf16"], picked["fp8"]),
    }
    if bf16["budget"] is not None and fp8["budget"] is not None:
        section["weights_ratio"] = fp8["budget"]["weights"] / bf16["budget"]["weights"]
    return section


def subset(work: Workload, num_requests: int, max_output: int | None) -> Workload:
    """The first `num_requests` of `work`, outputs capped at `max_output` tokens."""
    cap = max_output if max_output is not None else max(work.output_lens)
    return Workload(
        work.prompts[:num_requests], [min(n, cap) for n in work.output_lens[:num_requests]]
    )


def offload_utilization(budget: dict[str, int], saved_bytes: int, min_kv_bytes: int) -> float:
    """A utilization at which the resident model's KV cache falls half the offload's savings
    short of one max-model-len request, so the offloaded one has that much to spare."""
    others = (
        budget["weights"]
        + budget["peak_activations"]
        + budget["non_torch"]
        + budget["fragmentation_buffer"]
    )
    return (others + min_kv_bytes - saved_bytes // 2) / budget["total"]


def offload_section(
    model_dir: Path, args: argparse.Namespace, resident_budget: dict[str, int] | None
) -> dict[str, Any]:
    work = subset(w_nano(args.num_requests), args.offload_requests, args.offload_max_output)
    n = len(work.prompts)
    section: dict[str, Any] = {
        "workload": {"num_requests": n, "max_output": args.offload_max_output}
    }
    print(f"## offload {args.offload_gb} GiB: resident bf16 on the same {n} requests")
    engine, start = start_engine(model_dir, args)
    section["resident"] = {**start, **measure(engine, args, work, args.offload_itl_tokens)}
    runner = runner_of(engine)
    utilization = args.offload_utilization
    if utilization is None and resident_budget is not None:
        cfg = runner.model_config
        layer_bytes = runner.dtype.itemsize * linear_params_per_layer(
            cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        )
        plan = plan_offload(cfg.num_layers, layer_bytes, args.offload_gb)
        min_kv = -(-runner.max_model_len // args.block_size) * runner.bytes_per_block
        utilization = offload_utilization(resident_budget, plan.saved_bytes, min_kv)
    del engine, runner
    stop_ranks()
    section["gpu_memory_utilization"] = utilization
    if utilization is None:  # the CPU: no budget to refuse, and the offload is a no-op
        utilization = args.gpu_memory_utilization
    print(f"## offload: without it at utilization {utilization:.4f} (expect a refusal)")
    try:
        engine, _ = start_engine(model_dir, args, gpu_memory_utilization=utilization)
        section["without_offload"] = {"started": True, "budget": budget_terms(engine)}
        del engine
    except MemoryBudgetError as exc:
        section["without_offload"] = {"started": False, "refusal": str(exc)}
        print(f"  refused: {exc}")
    stop_ranks()
    print(f"## offload: --cpu-offload-gb {args.offload_gb} at utilization {utilization:.4f}")
    engine, start = start_engine(
        model_dir, args, gpu_memory_utilization=utilization, cpu_offload_gb=args.offload_gb
    )
    plan = runner_of(engine).offload_plan
    section["offload"] = {
        **start,
        "layer_ids": list(plan.layer_ids),
        "offloaded_bytes": plan.offloaded_bytes,
        "staging_bytes": plan.staging_bytes,
        **measure(engine, args, work, args.offload_itl_tokens),
    }
    del engine
    stop_ranks()
    resident, offloaded = section["resident"], section["offload"]
    section["throughput_ratio"] = offloaded["output_tok_s"] / resident["output_tok_s"]
    section["itl_ratio"] = offloaded["itl_s"] / resident["itl_s"]
    return section


def kv_bytes_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    requested = parse_bytes(args.kv_cache_memory_bytes)
    print(f"## --kv-cache-memory-bytes {requested}")
    quantization = "fp8" if args.fp8_only else "none"
    engine, start = start_engine(
        model_dir, args, kv_cache_memory_bytes=requested, quantization=quantization
    )
    runner = runner_of(engine)
    allocated = runner.pools.device_pool.nbytes
    bytes_per_block = runner.bytes_per_block
    section = {
        "requested": requested,
        "allocated": allocated,
        "num_gpu_blocks": start["num_gpu_blocks"],
        "bytes_per_block": bytes_per_block,
        "short_by_bytes": requested - allocated,
        "within_one_block": 0 <= requested - allocated < bytes_per_block,
        "budget": budget_terms(engine),
    }
    del engine, runner
    stop_ranks()
    return section


def table(report: dict[str, Any]) -> str:
    """The readable summary of `report`."""
    w, off, kv = report["weights"], report.get("offload"), report["kv_cache_memory_bytes"]
    lines = [f"# {report['device']}, {report['shape']}", ""]
    if "bf16" not in w:  # --fp8-only
        fp8 = w["fp8"]
        lines.append(
            f"fp8 weights: W-nano {fp8['output_tok_s']:,.0f} output tok/s, batch-1 ITL "
            f"{fp8['itl_s'] * 1e3:.3f} ms, {fp8['num_gpu_blocks']} KV blocks"
            + (
                ""
                if fp8["budget"] is None
                else f", weights {fp8['budget']['weights'] / GiB:.2f} GiB"
            )
        )
    else:
        lines += ["| figure | bf16 | fp8 | fp8 / bf16 |", "|---|---|---|---|"]
        for label, key, scale, fmt in (
            ("W-nano output tok/s", "output_tok_s", 1.0, ",.0f"),
            ("batch-1 ITL ms", "itl_s", 1e3, ".3f"),
        ):
            a, b = w["bf16"][key] * scale, w["fp8"][key] * scale
            lines.append(f"| {label} | {a:{fmt}} | {b:{fmt}} | {b / a:.3f} |")
        if "weights_ratio" in w:
            a, b = w["bf16"]["budget"]["weights"], w["fp8"]["budget"]["weights"]
            lines.append(f"| weights GiB (budget) | {a / GiB:.2f} | {b / GiB:.2f} | {b / a:.3f} |")
        acc = w["accuracy"]
        lines.append(
            f"\ngreedy agreement {acc['identical_token_share']:.4f} over {acc['num_positions']} "
            f"positions; |d logprob| mean {acc['logprob_abs_diff_mean']:.5f}, max "
            f"{acc['logprob_abs_diff_max']:.4f}"
        )
    if off is not None:
        refused = off["without_offload"]
        lines += [
            "",
            f"offload {report['offload_gb']} GiB at utilization {off['gpu_memory_utilization']}: "
            + (
                "without it refused"
                if not refused["started"]
                else "without it started"
                + (" (no GPU budget to refuse)" if off["gpu_memory_utilization"] is None else "")
            )
            + f"; {len(off['offload']['layer_ids'])} layers offloaded",
            f"| {off['workload']['num_requests']} requests | resident | offloaded | ratio |",
            "|---|---|---|---|",
            f"| output tok/s | {off['resident']['output_tok_s']:,.0f} | "
            f"{off['offload']['output_tok_s']:,.0f} | {off['throughput_ratio']:.3f} |",
            f"| batch-1 ITL ms | {off['resident']['itl_s'] * 1e3:.2f} | "
            f"{off['offload']['itl_s'] * 1e3:.2f} | {off['itl_ratio']:.2f} |",
        ]
    lines.append(
        f"\n--kv-cache-memory-bytes {kv['requested']}: allocated {kv['allocated']} "
        f"({kv['num_gpu_blocks']} blocks of {kv['bytes_per_block']}), short by "
        f"{kv['short_by_bytes']} bytes: within one block: {kv['within_one_block']}"
    )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    add("--model-dir", default=None, help="a config.json directory instead of --shape's")
    add("--device", choices=["cuda", "cpu"], default="cuda")
    add("--dtype", default="bfloat16")
    add("--out", required=True, help="the JSON report; the table goes beside it (.md)")
    add("--num-requests", type=int, default=256, help="W-nano's requests")
    add("--max-output", type=int, default=None, help="cap on W-nano's outputs (smoke tests)")
    add("--time-limit", type=float, default=300.0, help="seconds per W-nano run")
    add("--itl-tokens", type=int, default=256)
    add("--accuracy-prompts", type=int, default=32)
    add("--accuracy-steps", type=int, default=64)
    add("--accuracy-prompt-len", type=int, default=512)
    add("--offload-gb", type=float, default=8.0)
    add("--offload-utilization", type=float, default=None, help="default: from the bf16 budget")
    add("--offload-requests", type=int, default=64)
    add("--offload-max-output", type=int, default=128)
    add("--offload-itl-tokens", type=int, default=64)
    add("--no-offload", action="store_true", help="skip the offload section")
    add(
        "--fp8-only",
        action="store_true",
        help="the FP8 engine alone (a shape whose bf16 weights do not fit, such as the 70B on "
        "one GPU); implies --no-offload, and the KV byte budget runs in FP8",
    )
    add("--kv-cache-memory-bytes", default="20Gi")
    # build_engine's settings, at W-nano's values (`throughput.py`)
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=16384)
    add("--block-size", type=int, default=16)
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--enforce-eager", action="store_true")
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    add("--safety", choices=["on", "off"], default="on")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    args.kv_cache_dtype, args.tensor_parallel_size = "auto", 1  # build_engine reads them
    work = subset(w_nano(args.num_requests), args.num_requests, args.max_output)
    shape = args.model_dir or args.shape
    report: dict[str, Any] = {"shape": shape, "offload_gb": args.offload_gb, "device": "cpu"}
    if args.device == "cuda":
        bandwidth, rate = measure_copy_bandwidth(), measure_matmul_rate()
        report["device"] = torch.cuda.get_device_name()
        report["copy_bandwidth"], report["matmul_rate"] = bandwidth, rate
        # bf16's floor (docs/benchmarks.md): FP8 weights lower its weight term, not its KV term.
        report["floor_s"] = physical_floor(SHAPES[args.shape], work, bandwidth, rate)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (
            Path(args.model_dir) if args.model_dir else write_checkpoint(args.shape, Path(tmp))
        )
        report["weights"] = weights_section(model_dir, args, work)
        if not args.no_offload and not args.fp8_only:
            resident = report["weights"]["bf16"]["budget"]
            report["offload"] = offload_section(model_dir, args, resident)
        report["kv_cache_memory_bytes"] = kv_bytes_section(model_dir, args)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    summary = table(report)
    out.with_suffix(".md").write_text(summary)
    print(summary)
    return report


if __name__ == "__main__":
    main()
