"""W-agent (docs/benchmarks.md): multi-turn sessions whose contexts outgrow the GPU's KV cache,
through HTTP, with the host KV tier against without it, on one engine shape in one run.

Each session starts with a prompt of a few hundred tokens; each turn resends the whole context
(the previous prompt, the previous reply's tokens and 150-600 tokens of "tool output") and asks
for 32-256 tokens (`ignore_eos`). `--concurrency` workers take sessions round robin, one turn at
a time, so between two turns of a session every other session takes one: with enough sessions
their contexts cannot all stay on the GPU. The replies' tokens are read back from the text (the
benchmark's word tokenizer spells token i as "ti"), so the next turn resends exactly what the
engine produced. Tokens are counted from `usage`.

Each pass starts its own server: `reuse` (the sessions) and `fresh` (the same prompt and reply
lengths, every prompt new tokens: nothing to reuse), each with the tier off and on. /metrics is
read every `--sample-interval` seconds for the tier's bytes in use and at the end for the hits
by tier.

    PYTHONPATH=engine:memplan:. python benchmarks/agent.py --shape llama-3.1-8b \\
        --kv-cache-memory 4Gi --tier-gib 24 --sessions 32 --turns 8 --concurrency 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import serving_workload as wl
from benchmarks.serving_server import MODEL_NAME, model_config, prepare_model_dir, start_server

PASSES = ("reuse-off", "reuse-on", "fresh-off", "fresh-on")


@dataclass
class Session:
    """One session's plan: its first prompt, and per turn the reply length and the tool output
    that follows the reply."""

    first: list[int]
    reply_lens: list[int]
    tools: list[list[int]]
    context: list[int] = field(default_factory=list)
    turn: int = 0


def make_sessions(args: argparse.Namespace, vocab_size: int) -> list[Session]:
    rng = random.Random(args.seed)
    sessions = []
    for _ in range(args.sessions):
        first = [rng.randrange(vocab_size) for _ in range(rng.randint(200, 400))]
        replies = [rng.randint(32, 256) for _ in range(args.turns)]
        tools = [
            [rng.randrange(vocab_size) for _ in range(rng.randint(150, 600))]
            for _ in range(args.turns)
        ]
        sessions.append(Session(first, replies, tools, list(first)))
    return sessions


def final_context_tokens(sessions: list[Session]) -> int:
    """Tokens of every session's last prompt together."""
    return sum(
        len(s.first) + sum(s.reply_lens[:-1]) + sum(len(t) for t in s.tools[:-1]) for s in sessions
    )


@dataclass
class Record:
    session: int
    turn: int
    prompt_tokens: int
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def one_turn(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, record: Record
) -> list[int]:
    """Stream one completion; the reply's token ids."""
    body = wl.completion_body(MODEL_NAME, prompt, max_tokens)
    body["temperature"] = 0.0
    sent = time.monotonic()
    words: list[str] = []
    async with http.post(f"{url}/v1/completions", json=body) as response:
        record.status = response.status
        if response.status != 200:
            record.error = await response.text()
            return []
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                if record.ttft_s is None:
                    record.ttft_s = time.monotonic() - sent
                words += event["choices"][0]["text"].split()
            if usage := event.get("usage"):
                record.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens") or 0
    record.e2e_s = time.monotonic() - sent
    ids = [int(word[1:]) for word in words]
    assert len(ids) == record.completion_tokens, f"{len(ids)} words, usage says otherwise"
    return ids


async def serve_sessions(
    url: str, sessions: list[Session], concurrency: int, fresh: bool, seed: int, vocab: int
) -> tuple[list[Record], float]:
    """Every turn of every session, `concurrency` at a time, round robin; the records and the
    makespan. `fresh`: each prompt is new tokens of the length the session's would have."""
    rng = random.Random(seed + 1)
    ready: deque[int] = deque(range(len(sessions)))
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while ready:
                index = ready.popleft()
                s = sessions[index]
                prompt = [rng.randrange(vocab) for _ in s.context] if fresh else s.context
                record = Record(index, s.turn, len(prompt))
                records.append(record)
                reply = await one_turn(http, url, prompt, s.reply_lens[s.turn], record)
                if record.status != 200:
                    continue  # the session ends here; the report counts the failure
                if fresh:  # the same lengths as the session's own next turn
                    reply = [rng.randrange(vocab) for _ in reply]
                s.context += reply + s.tools[s.turn]
                s.turn += 1
                if s.turn < len(s.reply_lens):
                    ready.append(index)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.monotonic() - started


def read_metrics(url: str) -> dict[str, float]:
    """The series this benchmark reports, summed over labels but the tier of the hits."""
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tier = sample.labels.get("tier")
            key = f"{sample.name}{{tier={tier}}}" if tier else sample.name
            found[key] = found.get(key, 0.0) + sample.value
    return found


async def sample_host_bytes(
    url: str, interval: float, peak: list[float], done: asyncio.Event
) -> None:
    while not done.is_set():
        reading = await asyncio.to_thread(read_metrics, url)
        peak[0] = max(peak[0], reading.get("pagekeeper_kv_offload_bytes_used", 0.0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), interval)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_pass(args: argparse.Namespace, model_dir: Path, name: str, log: Path) -> dict[str, Any]:
    workload, tier = name.split("-")
    vocab = int(model_config(args)["vocab_size"])
    sessions = make_sessions(args, vocab)
    settings = wl.EngineSettings(
        args.device, "auto", args.max_model_len, args.max_num_seqs, args.block_size,
        args.max_num_batched_tokens, None, True, args.enforce_eager,
    )  # fmt: skip
    extra = ["--kv-cache-memory-bytes", args.kv_cache_memory]
    extra += ["--kv-offloading-size", str(args.tier_gib if tier == "on" else 0)]
    server_args = argparse.Namespace(
        api_server_count=None, server_cpus=None, engine_arg=extra + args.engine_arg,
        start_timeout=args.start_timeout,
    )  # fmt: skip
    server = start_server(model_dir, settings, server_args, log)
    try:
        before = read_metrics(server.url)
        peak = [0.0]

        async def measured() -> tuple[list[Record], float]:
            done = asyncio.Event()
            sampler = asyncio.create_task(
                sample_host_bytes(server.url, args.sample_interval, peak, done)
            )
            try:
                return await serve_sessions(
                    server.url, sessions, args.concurrency, workload == "fresh", args.seed, vocab
                )
            finally:
                done.set()
                await sampler

        records, makespan = asyncio.run(measured())
        after = read_metrics(server.url)
    finally:
        exit_code = server.stop()
    ok = [r for r in records if r.status == 200]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if "_total" in k}
    return {
        "pass": name,
        "server_start_s": round(server.start_s, 1),
        "server_exit_code": exit_code,
        "requests": len(records),
        "non_200": [(r.status, (r.error or "")[:200]) for r in records if r.status != 200],
        "output_tok_s": sum(r.completion_tokens for r in ok) / makespan,
        "makespan_s": makespan,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens_usage": sum(r.cached_tokens for r in ok),
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 0.5),
        "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 0.99),
        "e2e_p50_s": percentile([r.e2e_s for r in ok], 0.5),
        "host_bytes_peak": peak[0],
        "host_bytes_capacity": after.get("pagekeeper_kv_offload_bytes_capacity", 0.0),
        "final_context_tokens": final_context_tokens(make_sessions(args, vocab)),
        "metrics_delta": delta,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--model-dir", default=None, help="a config.json (dummy weights) instead")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache-memory", default="4Gi", help="the GPU's KV cache, per GPU")
    p.add_argument("--tier-gib", type=float, default=24.0, help="--kv-offloading-size, on")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--sample-interval", type=float, default=1.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--engine-arg", action="append", default=[], help="one more server flag")
    p.add_argument("--json", default=None, help="write the report here (after every pass)")
    p.add_argument("--log-dir", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = prepare_model_dir(args, root)
        logs = Path(args.log_dir) if args.log_dir else root
        report: dict[str, Any] = {"args": vars(args), "passes": {}}
        for name in args.passes:
            result = run_pass(args, model_dir, name, logs / f"server-{name}.log")
            report["passes"][name] = result
            print(json.dumps({k: v for k, v in result.items() if k != "metrics_delta"}))
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
    report["ratios"] = ratios(report["passes"])
    print(json.dumps(report["ratios"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def ratios(passes: dict[str, Any]) -> dict[str, float]:
    """Tier on against off, per workload: what the acceptance reads."""
    found = {}
    for workload in ("reuse", "fresh"):
        on, off = passes.get(f"{workload}-on"), passes.get(f"{workload}-off")
        if on and off:
            found[f"{workload}_tok_s_on_over_off"] = on["output_tok_s"] / off["output_tok_s"]
            found[f"{workload}_ttft_p50_on_over_off"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    return found


if __name__ == "__main__":
    main()
