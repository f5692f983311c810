"""Memory safety on the GPU: KV capacity against the budget arithmetic, the W-burst OOM
reproducer, and the W-soak fragmentation series (BENCHMARKS.md).

    PYTHONPATH=engine python benchmarks/memory.py capacity
    PYTHONPATH=engine python benchmarks/memory.py burst --duration 600
    PYTHONPATH=engine python benchmarks/memory.py soak --duration 1800

`capacity` builds the runner in-process at --gpu-memory-utilization 0.9 and checks the KV pool
against the arithmetic, then runs the worst-case step on the real pool and checks that the
device's used memory stays within the allowed share. `burst` and `soak` start the server
(`pagekeeper_engine.cli serve`) on a dummy Llama-3.1-8B checkpoint and drive it over HTTP with
streaming completions, scraping /metrics and nvidia-smi every `--sample-every` seconds. Every
request ends as served (200 and finished), rejected (429/503) or lost (anything else); the
goal for lost is 0. Results go to stdout and, as JSON, to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.shapes import SHAPES

LLAMA_8B = SHAPES["llama-3.1-8b"]
MiB = 2**20


def write_checkpoint(root: Path) -> Path:
    """config.json at the 8B shape and a word-level tokenizer over the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(LLAMA_8B))
    vocab = {f"t{i}": i for i in range(LLAMA_8B["vocab_size"])}
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
        "startup_seconds": time.monotonic() - started,
    }


# -- burst and soak ---------------------------------------------------------------------------


@dataclass
class Tally:
    served: int = 0
    rejected: int = 0
    lost: int = 0
    lost_reasons: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def lose(self, reason: str) -> None:
        self.lost += 1
        self.lost_reasons[reason] = self.lost_reasons.get(reason, 0) + 1


def draw_request(rng: random.Random, kind: str) -> tuple[list[int], int]:
    """W-burst: long prompts (8k-28k) and short chats (50-600); W-soak adds prefix groups."""
    if kind == "long":
        n, out = rng.randint(8192, 28672), rng.randint(16, 128)
    elif kind.startswith("group"):
        shared = random.Random(kind).choices(range(1000, 120000), k=2048)
        return shared + rng.choices(range(1000, 120000), k=rng.randint(20, 300)), 64
    else:
        n, out = rng.randint(50, 600), rng.randint(32, 256)
    return rng.choices(range(1000, 120000), k=n), out


# `--sampling mixed`: what clients of one server send in practice. Greedy rows beside random
# ones send a step through the sampler's mixed path, top-k / top-p through its cut, a seed
# through its own generator, min_tokens through the stop mask.
MIXED_SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    {"temperature": 0.7, "seed": 7},
    {"temperature": 0.0, "min_tokens": 8},
)


def draw_sampling(rng: random.Random, mode: str) -> dict[str, Any]:
    return {"temperature": 0.7} if mode == "uniform" else dict(rng.choice(MIXED_SAMPLING))


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    tally: Tally,
    sampling: dict[str, Any],
) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        **sampling,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    last: float | None = None
    finished = False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status in (429, 503):
                tally.rejected += 1
                await response.read()
                return
            if response.status != 200:
                tally.lose(f"http {response.status}")
                await response.read()
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    tally.lose(event["error"].get("code") or "stream error")
                    return
                now = time.monotonic()
                if last is None:
                    tally.ttft.append(now - started)
                else:
                    tally.itl.append(now - last)
                last = now
                if event["choices"][0].get("finish_reason"):
                    finished = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.lose(type(exc).__name__)
        return
    if finished:
        tally.served += 1
    else:
        tally.lose("no finish_reason")


def parse_metrics(text: str) -> dict[str, float]:
    wanted = (
        "pagekeeper_allocator_",
        "pagekeeper_oom_events_total",
        "pagekeeper_kv_internal_fragmentation_ratio",
        "pagekeeper_step_token_budget",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    )
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(wanted):
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{")[0]
            if "kind=" in name_labels:
                name += "{" + name_labels.split("kind=")[1].split(",")[0].strip('"}') + "}"
            if "_info" in name:
                name = name_labels
            values[name] = float(value)
    return values


def gpu_used_mib() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    return float(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else -1.0


async def drive(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = random.Random(0)
    tally = Tally()
    series: list[dict[str, float]] = []
    deadline = time.monotonic() + args.duration
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker(index: int) -> None:
            while time.monotonic() < deadline:
                if args.mode == "burst":
                    kind = "long" if rng.random() < args.long_fraction else "short"
                else:
                    kind = rng.choice(["short", "short", "long", f"group{rng.randint(0, 7)}"])
                prompt, max_tokens = draw_request(rng, kind)
                sampling = draw_sampling(rng, args.sampling)
                await one_request(session, url, prompt, max_tokens, tally, sampling)

        async def sampler() -> None:
            started = time.monotonic()
            # Each sample also goes to a JSON-lines file as it is taken, so a run cut short
            # still leaves its series.
            with open(Path(args.out).with_suffix(".series.jsonl"), "w") as series_file:
                while time.monotonic() < deadline + 5:
                    try:
                        async with session.get(f"{url}/metrics") as response:
                            sample = parse_metrics(await response.text())
                    except aiohttp.ClientError:
                        sample = {}
                    sample["t"] = round(time.monotonic() - started, 1)
                    sample["gpu_used_mib"] = gpu_used_mib()
                    sample.update(served=tally.served, rejected=tally.rejected, lost=tally.lost)
                    series.append(sample)
                    series_file.write(json.dumps(sample) + "\n")
                    series_file.flush()
                    await asyncio.sleep(args.sample_every)

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        sampling.cancel()
    return {"tally": tally, "series": series}


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_server_workload(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(model_dir),
        "--served-model-name", "bench", "--load-format", "dummy", "--dtype", "bfloat16",
        "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--swap-space", str(args.swap_space),
        "--termination-log-path", str(Path(args.out).with_suffix(".termination")),
    ]  # fmt: skip
    if args.max_waiting_requests is not None:
        argv += ["--max-waiting-requests", str(args.max_waiting_requests)]
    if args.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    log = open(Path(args.out).with_suffix(".server.log"), "wb")  # noqa: SIM115
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited with {server.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - started > 300:
                raise RuntimeError("server not ready within 300 s")
            time.sleep(1.0)
        startup_s = time.monotonic() - started
        budget = parse_budget(url)
        driven = asyncio.run(drive(args, url))
    finally:
        server.terminate()
        exit_code = server.wait(timeout=120)
        log.close()
    tally: Tally = driven["tally"]
    series = driven["series"]
    frag = [s.get("pagekeeper_allocator_fragmentation_bytes", 0.0) for s in series]
    reserved = [s.get("pagekeeper_allocator_reserved_bytes", 0.0) for s in series]
    return {
        "startup_seconds": startup_s,
        "budget": budget,
        "served": tally.served,
        "rejected": tally.rejected,
        "lost": tally.lost,
        "lost_reasons": tally.lost_reasons,
        "oom_events": {k: v for k, v in series[-1].items() if k.startswith("pagekeeper_oom")},
        "server_exit_code": exit_code,
        "ttft_p50_s": quantile(tally.ttft, 0.5),
        "ttft_p99_s": quantile(tally.ttft, 0.99),
        "itl_p50_s": quantile(tally.itl, 0.5),
        "itl_p99_s": quantile(tally.itl, 0.99),
        "fragmentation_peak_mib": max(frag, default=0.0) / MiB,
        "fragmentation_last_mib": frag[-1] / MiB if frag else 0.0,
        "fragmentation_share_of_reserved_max": max(
            (f / r for f, r in zip(frag, reserved, strict=True) if r), default=0.0
        ),
        "kv_internal_fragmentation_mean": statistics.fmean(
            [s.get("pagekeeper_kv_internal_fragmentation_ratio", 0.0) for s in series] or [0.0]
        ),
        "gpu_used_peak_mib": max((s["gpu_used_mib"] for s in series), default=-1.0),
        "series": series,
    }


def parse_budget(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    terms = {}
    for line in text.splitlines():
        if line.startswith("pagekeeper_memory_budget_bytes{"):
            term = line.split('term="')[1].split('"')[0]
            terms[term] = float(line.rpartition(" ")[2])
    return terms


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
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "llama-3.1-8b")
        if args.mode == "capacity":
            result = run_capacity(args, model_dir)
        else:
            result = run_server_workload(args, model_dir)
    Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=1, default=asdict))
    summary = {k: v for k, v in result.items() if k != "series"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
