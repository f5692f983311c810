"""The HTTP side of `memory.py`'s W-burst and W-soak: the server, the clients, and what is
sampled while they run.

`run_server_workload` starts `pagekeeper_engine.cli serve` on a dummy checkpoint (at
`--tensor-parallel-size` ranks when asked), streams completions from `--concurrency` clients for
`--duration` seconds, and samples /metrics and every rank's GPU (nvidia-smi) every
`--sample-every` seconds. Every request ends served (200 and a finish reason), rejected (429 or
503) or lost (anything else). Each rank's peak device memory is held against the budget that
rank measured at start-up (`pagekeeper_memory_budget_bytes{rank=...}`).
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
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

MiB = 2**20
READY_TIMEOUT_S = 600  # a 70B shape at TP 4 loads and captures its graphs in about 80 s


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


def parse_gpu_used(text: str) -> list[float]:
    """`nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits` -> MiB per GPU."""
    return [float(line) for line in text.split() if line.strip()]


def gpu_used_mib() -> list[float]:
    """Each visible GPU's used memory in MiB, in the engine's rank order (rank r runs on the
    r-th visible GPU); empty when nvidia-smi cannot say."""
    argv = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        argv.append(f"--id={visible}")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no NVIDIA driver tools on this host
        return []
    return parse_gpu_used(out.stdout) if out.returncode == 0 else []


async def drive(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = random.Random(0)
    tally = Tally()
    series: list[dict[str, Any]] = []
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
                    sample: dict[str, Any] = {}
                    try:
                        async with session.get(f"{url}/metrics") as response:
                            sample.update(parse_metrics(await response.text()))
                    except aiohttp.ClientError:
                        pass  # the sample keeps its time, GPU figures and tally
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
        "--tensor-parallel-size", str(args.tensor_parallel_size),
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
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"server not ready within {READY_TIMEOUT_S} s")
            time.sleep(1.0)
        startup_s = time.monotonic() - started
        budgets = fetch_budgets(url)
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
        "budgets": budgets,
        "ranks": rank_memory(series, budgets),
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
        "series": series,
    }


def parse_budgets(text: str) -> list[dict[str, float]]:
    """/metrics' `pagekeeper_memory_budget_bytes` -> one {term: bytes} per rank, in rank
    order (the engine exports every rank's measured budget)."""
    by_rank: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pagekeeper_memory_budget_bytes":
            continue
        for sample in family.samples:
            rank = int(sample.labels.get("rank", "0"))
            by_rank.setdefault(rank, {})[sample.labels["term"]] = sample.value
    return [by_rank[rank] for rank in sorted(by_rank)]


def fetch_budgets(url: str) -> list[dict[str, float]]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return parse_budgets(response.read().decode())


def rank_memory(
    series: list[dict[str, Any]], budgets: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """Per rank: the peak of its GPU's used memory over the samples (nvidia-smi, the whole
    device: CUDA context, NCCL and every allocation) against the bytes its budget allows."""
    ranks = []
    for rank, budget in enumerate(budgets):
        used = [s["gpu_used_mib"][rank] for s in series if len(s["gpu_used_mib"]) > rank]
        peak = max(used, default=float("nan"))
        allowed = budget["allowed"] / MiB
        ranks.append(
            {"rank": rank, "peak_used_mib": peak, "allowed_mib": allowed, "within": peak <= allowed}
        )
    return ranks


def workload_failures(result: dict[str, Any]) -> list[str]:
    """What makes a W-burst or W-soak run fail its goals (docs/benchmarks.md): a lost request, an
    OOM event of any kind, a rank whose GPU went past its budget or could not be read, a server
    that did not exit 0. Empty when it passed."""
    failures = []
    if result["lost"]:
        failures.append(f"{result['lost']} requests lost ({result['lost_reasons']})")
    failures += [f"{name} = {value:g}" for name, value in result["oom_events"].items() if value]
    for rank in result["ranks"]:
        if not rank["within"]:
            failures.append(
                f"rank {rank['rank']} peaked at {rank['peak_used_mib']:,.0f} MiB of the "
                f"{rank['allowed_mib']:,.0f} its budget allowed"
            )
    if not result["ranks"]:
        failures.append("no rank's budget was read")
    if result["server_exit_code"] != 0:
        failures.append(f"the server exited with {result['server_exit_code']}")
    return failures
