"""W-chat online serving (docs/benchmarks.md): streaming completions over HTTP from client
processes, beside the same requests at the same concurrency through the offline engine in the same
run.

The server (`pagekeeper_engine.cli serve`, random weights at the real shape) runs as a
subprocess, or `--url` names one already running. Each `--concurrency` level keeps C streams in
flight across `--client-processes` processes (closed loop); each `--request-rate` level sends on
seeded Poisson arrivals (open loop). /metrics is read after each level. Then the server is
stopped (its GPU memory freed) and each closed-loop level's requests run through the offline
engine (`offline_engine.build_engine`, with the server's engine settings), which also times the
decode step at that batch. torch is imported only by the offline part and by writing a shape's
checkpoint; the client processes never import it. The server's side is `serving_server.py`,
the clients' `serving_client.py`.

    PYTHONPATH=engine:. python benchmarks/serving.py --shape qwen3-0.6b --concurrency 32 128
    PYTHONPATH=engine:. python benchmarks/serving.py --device cpu --model-dir CKPT \\
        --concurrency 4 --num-requests 16 --prompt-max 64 --output-max 16 --no-offline
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_report
from benchmarks import serving_workload as wl
from benchmarks.serving_client import run_online
from benchmarks.serving_server import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPO,
    http_get,
    model_config,
    prepare_model_dir,
    start_server,
)
from benchmarks.shapes import SHAPES, prefill_flops


def run_offline(
    model_dir: Path | None,
    settings: wl.EngineSettings,
    runs: list[tuple[wl.Level, wl.LevelRequests]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each level's requests through one in-process engine, after an untimed warm-up."""
    assert model_dir is not None, "the offline engine runs on a checkpoint prepared here"
    import torch  # noqa: PLC0415

    from benchmarks import offline_engine  # noqa: PLC0415

    fields = asdict(settings)
    # the server's settings, not W-nano's (max_model_len 2048, CUDA, no prefix caching)
    args = argparse.Namespace(**fields, async_scheduling=None, safety="on")
    engine, start = offline_engine.build_engine(model_dir, args, **fields)
    env = {"torch": torch.__version__, **start}
    if settings.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    print(f"# offline engine: torch {env['torch']}, {env.get('gpu', 'CPU')}")
    results = []
    for level, (work, warm) in runs:
        assert level.concurrency is not None, "offline runs are closed-loop"
        run_closed(engine, warm, level.concurrency, f"warm-{level.label}")
        results.append(run_closed(engine, work, level.concurrency, level.label))
    return env, results


def measure_matmul_rate() -> float:
    """The bf16 matmul rate (FLOP/s), measured with the GPU free (the server stopped)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kernels import measure_matmul_rate as measure  # noqa: PLC0415 (imports torch)

    return float(measure())


def first_wave_floor_ms(
    config: dict[str, Any], work: wl.ChatWorkload, c: int, rate: float, num_gpus: int = 1
) -> float:
    """The least TTFT the last of a closed loop's first C requests can see: all C prompts
    arrive at once, so the last first token waits for every one of their prefills, split
    evenly over the `num_gpus` GPUs of a tensor-parallel server, each at `rate` FLOP/s."""
    flops = prefill_flops(config, (len(p) for p in work.prompts[:c]))
    return flops / (rate * num_gpus) * 1e3


def server_num_gpus(engine_args: list[str]) -> int:
    """The GPUs the server's `--engine-arg`s split the model over, read by the engine's own
    parser."""
    from pagekeeper_engine.flags import build_parser  # noqa: PLC0415 (no torch)

    namespace, _ = build_parser().parse_known_args(["model", *engine_args])
    return int(namespace.tensor_parallel_size)


def run_closed(engine: Any, work: wl.ChatWorkload, concurrency: int, tag: str) -> dict[str, Any]:
    """Keep `concurrency` requests in the engine, adding the next whenever one finishes."""
    from pagekeeper_engine.core.sampling_params import SamplingParams  # noqa: PLC0415

    pending = iter(range(len(work.prompts)))

    def admit() -> None:
        if (i := next(pending, None)) is not None:
            n = work.output_lens[i]
            params = SamplingParams(max_tokens=n, temperature=wl.TEMPERATURE, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", work.prompts[i], params)

    steps, num_output, num_finished, num_failed = [], 0, 0, 0
    start = time.perf_counter()
    for _ in range(concurrency):
        admit()
    while engine.has_work():
        tokens_before, step_start = engine.num_batched_tokens_total, time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_start
        scheduled = engine.num_batched_tokens_total - tokens_before
        num_outputs = sum(bool(o.new_token_ids) for o in outputs)
        steps.append(serving_report.StepSample(seconds, num_outputs, scheduled))
        for out in outputs:
            num_output += len(out.new_token_ids)
            num_failed += out.error is not None
            if out.finished:
                num_finished += 1
                admit()
    seconds = time.perf_counter() - start
    step_s, num_steps = serving_report.decode_step_time(steps, concurrency)
    return {
        "seconds": seconds,
        "num_output_tokens": num_output,
        "output_tok_s": num_output / seconds,
        "num_finished": num_finished,
        "num_failed": num_failed,
        "num_steps": len(steps),
        "decode_step_ms": None if step_s is None else step_s * 1e3,
        "num_decode_steps_timed": num_steps,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="W-chat: online serving beside the offline engine")
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    add("--model-dir", default=None, help="a checkpoint instead of --shape (gets a tokenizer.json)")
    add("--url", default=None, help="an engine server already running (not started here)")
    add("--model-name", default=MODEL_NAME, help="the served model name, with --url")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: float32, for smoke runs")
    add("--concurrency", type=int, nargs="*", default=[32, 128], help="closed-loop levels")
    add("--request-rate", type=float, nargs="*", default=[], help="Poisson levels, requests/s")
    add("--num-requests", type=int, default=None, help="per level; default 4 x C, or 512")
    for flag, default in [
        ("--prompt-min", None), ("--prompt-max", 2048), ("--output-min", None),
        ("--output-max", 512), ("--seed", 0), ("--client-processes", 4), ("--max-num-seqs", 256),
        ("--block-size", 16), ("--max-num-batched-tokens", None), ("--api-server-count", None),
    ]:  # fmt: skip
        add(flag, type=int, default=default)
    add("--prefix-sharing", action="store_true", help="groups of 16 share a 1,024-token prefix")
    add(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="text: prompts as words the server tokenizes (one token each), as most clients send",
    )
    add(
        "--modes",
        nargs="+",
        choices=["stream", "whole"],
        default=["stream"],
        help="each level streamed (SSE), and/or answered in one body (a '-whole' level)",
    )
    add("--max-model-len", type=int, default=None, help=f"default {MAX_MODEL_LEN} or the model's")
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--enforce-eager", action="store_true")
    add("--engine-arg", action="append", default=[], help="a server argument: --engine-arg=--x")
    add("--offline", action=argparse.BooleanOptionalAction, default=None, help="default: no --url")
    add("--start-timeout", type=float, default=1200.0)
    add("--request-timeout", type=float, default=600.0, help="seconds without a byte")
    add("--server-log", default=None)
    add("--server-cpus", default=None, help="CPUs the server may use (taskset's list: 0-9)")
    add("--client-cpus", default=None, help="CPUs the client processes may use (10-15)")
    add("--api-key", default=None, help="the server's --api-key: clients send it as a bearer")
    add("--json", default=None)
    args = parser.parse_args()
    for part, low in (("prompt", 64), ("output", 32)):  # an unset minimum follows a lower maximum
        given, high = getattr(args, f"{part}_min"), getattr(args, f"{part}_max")
        setattr(args, f"{part}_min", min(low, high) if given is None else given)
        if not 1 <= getattr(args, f"{part}_min") <= high:
            parser.error(f"--{part}-min must be in [1, --{part}-max]")
    args.offline = args.url is None if args.offline is None else args.offline
    return args


def main() -> None:
    args = parse_args()
    config = model_config(args)
    max_model_len = args.max_model_len or min(
        MAX_MODEL_LEN, config.get("max_position_embeddings", MAX_MODEL_LEN)
    )
    prefix = wl.PREFIX_LEN if args.prefix_sharing else 0
    if args.prompt_max + prefix + args.output_max > max_model_len:
        sys.exit(f"--prompt-max + --output-max (+ the shared prefix) exceed {max_model_len} tokens")
    settings = wl.EngineSettings(
        args.device, "bfloat16" if args.device == "cuda" else "float32", max_model_len,
        args.max_num_seqs, args.block_size, args.max_num_batched_tokens,
        args.gpu_memory_utilization, args.enable_prefix_caching, args.enforce_eager,
    )  # fmt: skip
    streams = [mode == "stream" for mode in args.modes]
    levels = [wl.Level(concurrency=c, stream=s) for c in args.concurrency for s in streams]
    levels += [wl.Level(rate=r, stream=s) for r in args.request_rate for s in streams]
    lengths = {
        "vocab_size": config["vocab_size"],
        "prompt_lens": (args.prompt_min, args.prompt_max),
        "output_lens": (args.output_min, args.output_max),
        "prefix_sharing": args.prefix_sharing,
    }
    runs = [(lv, wl.level_workloads(lv, args.seed, args.num_requests, **lengths)) for lv in levels]
    report: dict[str, Any] = {
        "model": args.model_dir or args.shape,
        "workload": {**lengths, "seed": args.seed, "client_processes": args.client_processes},
        "settings": asdict(settings),
        "engine_args": args.engine_arg,
        "levels": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_model_dir(args, Path(tmp)) if args.url is None or args.offline else None
        log = Path(args.server_log or Path(tmp) / "engine.log")
        server = None if args.url is not None else start_server(model_dir, settings, args, log)
        url = server.url if server is not None else args.url
        print(f"# W-chat {report['model']} on {args.device}, {json.dumps(report['workload'])}")
        print(f"# server {url}" + (f" ready in {server.start_s:.1f} s" if server else ""))
        try:
            for level, requests in runs:
                row: dict[str, Any] = {"level": level.label, "concurrency": level.concurrency}
                row["rate"] = level.rate
                records = run_online(url, level, requests, args)
                row["online"] = serving_report.summarize(records, first_wave=level.concurrency or 0)
                status, text = http_get(f"{url}/metrics")
                memory = serving_report.memory_metrics(text) if status == 200 else {"error": text}
                row["memory"] = memory
                print(serving_report.format_online(row), flush=True)
                report["levels"].append(row)
        finally:
            if server is not None:
                report["server"] = {"start_s": server.start_s, "exit_code": server.stop()}
        if server is not None and server.proc.returncode != 0:
            print(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        if args.device == "cuda" and args.url is None:
            rate = report["matmul_flop_s"] = measure_matmul_rate()
            gpus = server_num_gpus(args.engine_arg)
            for row, (level, (work, _)) in zip(report["levels"], runs, strict=True):
                if level.concurrency is not None and level.stream:  # a TTFT needs a stream
                    floor = first_wave_floor_ms(config, work, level.concurrency, rate, gpus)
                    row["first_wave_floor_ms"] = floor
                    print(
                        f"{row['level']:>6} first wave: TTFT p99 "
                        f"{row['online']['ttft_first_wave_ms']['p99'] or 0:,.0f} ms; its prefill "
                        f"alone takes {floor:,.0f} ms at the measured {rate / 1e12:.0f} TFLOP/s "
                        f"on each of {gpus} GPU(s)"
                    )
        if args.offline:
            closed = [run for run in runs if run[0].concurrency is not None]
            report["offline_env"], results = run_offline(model_dir, settings, closed)
            rows = [row for row in report["levels"] if row["concurrency"] is not None]
            for row, result in zip(rows, results, strict=True):
                row["offline"] = result
                row.update(serving_report.compare(row["online"], result))
                print(serving_report.format_offline(row))
    print(serving_report.format_table(report["levels"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
