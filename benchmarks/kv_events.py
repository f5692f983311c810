"""What KV cache events cost, through HTTP (issue 60): the same server with `--kv-events-config`
(zmq publisher, vLLM's array encoding) against without, prefix caching on in both (the events
describe the prefix cache), on two loads that each server start serves in turn:

- nano: W-nano's requests (256 prompts of 100-1,024 tokens, replies of 100-1,024, all at once);
- chat: W-chat at 128 streams (512 requests, prompts 64-2,048 tokens, replies 32-512).

Servers start off, on, off, on, so a drift of the card shows as a spread between the repeats;
the ratio of each load is the median of its "on" passes over the median of its "off" ones.
Writes the report (each pass's output tok/s, TTFT and ITL, the ratios) to `--json` after each
server, each server's log to `--log-dir`; exits non-zero if a pass failed a request or a server
with events on never started its publisher. `benchmarks/kv_events_gpu.sh` runs it on one GPU.

    PYTHONPATH=engine:memplan:. python benchmarks/kv_events.py --json kv_events.json
    PYTHONPATH=engine:memplan:. python benchmarks/kv_events.py --smoke --device cpu \\
        --model-dir CKPT --json kv_events.json      # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_report
from benchmarks import serving_workload as wl
from benchmarks.serving_client import run_online
from benchmarks.serving_server import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    model_config,
    prepare_model_dir,
    start_server,
)
from benchmarks.shapes import SHAPES

PUBLISHER_STARTED = "publishing KV events"  # the server's log line once its publisher binds


@dataclasses.dataclass(frozen=True)
class Load:
    """One closed-loop load: `num_requests` at `concurrency`, lengths uniform in their ranges."""

    name: str
    concurrency: int
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]


LOADS = (
    Load("nano", 256, 256, (100, 1024), (100, 1024)),
    Load("chat", 128, 512, (64, 2048), (32, 512)),
)
SMOKE_LOADS = (
    Load("nano", 8, 16, (16, 64), (8, 16)),
    Load("chat", 4, 16, (64, 64), (16, 16)),
)


def events_flag(port: int) -> str:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return f"--kv-events-config={json.dumps(config, separators=(',', ':'))}"


def pass_names(repeats: int) -> list[tuple[int, str]]:
    """(repeat, events) in serving order: off then on, `repeats` times."""
    return [(r, events) for r in range(1, repeats + 1) for events in ("off", "on")]


def ratios(passes: dict[str, dict[str, Any]], loads: tuple[Load, ...]) -> dict[str, float]:
    """Each load's median output tok/s with events on over its median with them off."""
    out = {}
    for load in loads:
        medians = {
            events: statistics.median(
                p["output_tok_s"] for name, p in passes.items()
                if name.startswith(f"{load.name}-{events}-")
            )
            for events in ("off", "on")
        }  # fmt: skip
        out[load.name] = medians["on"] / medians["off"]
    return out


@dataclasses.dataclass
class Pass:
    """One server start: each load's figures, the server's start and exit, and what failed."""

    figures: dict[str, dict[str, Any]]
    server: dict[str, float | int | None]
    failed: list[str]


def serve_pass(
    args: argparse.Namespace, model_dir: Path, settings: wl.EngineSettings, events: str, log: Path
) -> Pass:
    """One server start serving every load in turn."""
    loads = SMOKE_LOADS if args.smoke else LOADS
    extra = [events_flag(args.events_port)] if events == "on" else []
    server_args = argparse.Namespace(**{**vars(args), "engine_arg": [*args.engine_arg, *extra]})
    server = start_server(model_dir, settings, server_args, log)
    vocab = model_config(args)["vocab_size"]
    figures: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    exit_code = None
    try:
        for load in loads:
            level = wl.Level(concurrency=load.concurrency)
            requests = wl.level_workloads(
                level, args.seed, load.num_requests, vocab_size=vocab,
                prompt_lens=load.prompt_lens, output_lens=load.output_lens, prefix_sharing=False,
            )  # fmt: skip
            online = serving_report.summarize(
                run_online(server.url, level, requests, args), first_wave=load.concurrency
            )
            figures[load.name] = {
                key: online[key]
                for key in ("output_tok_s", "num_ok", "num_requests", "ttft_ms", "itl_ms")
            }
            if online["num_ok"] != online["num_requests"]:
                failed.append(f"{load.name}: {online['num_ok']}/{online['num_requests']} ok")
    finally:
        exit_code = server.stop()
    if events == "on" and PUBLISHER_STARTED not in log.read_text():
        failed.append("the server never started its KV event publisher")
    return Pass(figures, {"start_s": server.start_s, "exit_code": exit_code}, failed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads = SMOKE_LOADS if args.smoke else LOADS
    config = model_config(args)
    max_model_len = min(MAX_MODEL_LEN, config.get("max_position_embeddings", MAX_MODEL_LEN))
    settings = wl.EngineSettings(
        args.device, "bfloat16" if args.device == "cuda" else "float32", max_model_len,
        256, 16, None, 0.9, True, False,
    )  # fmt: skip
    longest = max(load.prompt_lens[1] + load.output_lens[1] for load in loads)
    if longest > max_model_len:
        sys.exit(f"a load's longest request ({longest} tokens) exceeds {max_model_len}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "model": args.model_dir or args.shape,
        "settings": dataclasses.asdict(settings),
        "loads": [dataclasses.asdict(load) for load in loads],
        "passes": {},
    }
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_model_dir(args, Path(tmp))
        for repeat, events in pass_names(args.repeats):
            tag = f"{events}-{repeat}"
            served = serve_pass(args, model_dir, settings, events, log_dir / f"{tag}.log")
            failed += [f"{tag}: {line}" for line in served.failed]
            report.setdefault("servers", {})[tag] = served.server
            for name, figure in served.figures.items():
                report["passes"][f"{name}-{tag}"] = figure
                print(f"{name}-{tag}: {figure['output_tok_s']:,.0f} output tok/s", flush=True)
            Path(args.json).write_text(json.dumps(report, indent=1))  # a cut run keeps its passes
    report["ratios"] = ratios(report["passes"], loads) if not failed else {}
    report["failed"] = failed
    Path(args.json).write_text(json.dumps(report, indent=1))
    for name, ratio in report["ratios"].items():
        print(f"{name}: events on / off output tok/s = {ratio:.3f}")
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="KV events' cost through HTTP, off against on")
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    add("--model-dir", default=None, help="a checkpoint (its config.json) instead of a shape")
    add("--device", choices=["cuda", "cpu"], default="cuda")
    add("--smoke", action="store_true", help="tiny loads: the plumbing, on the CPU")
    add("--repeats", type=int, default=2, help="server starts with events off (and as many on)")
    add("--events-port", type=int, default=5557, help="the publisher's port")
    add("--seed", type=int, default=0)
    add("--client-processes", type=int, default=4)
    add("--engine-arg", action="append", default=[], help="one more server flag: --engine-arg=--x")
    add("--start-timeout", type=float, default=1200.0)
    add("--request-timeout", type=float, default=600.0, help="seconds without a byte")
    add("--log-dir", required=True, help="each server's log")
    add("--json", required=True)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    # what serving_server.start_server and serving_client.run_online read
    args.api_server_count, args.api_key, args.server_cpus, args.client_cpus = None, None, None, None
    args.model_name, args.prompt_format = MODEL_NAME, "ids"
    return args


if __name__ == "__main__":
    sys.exit(main())
