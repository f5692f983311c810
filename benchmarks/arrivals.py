"""W-burst as users meet it: waves of simultaneous arrivals with text prompts, most clients
leaving after two chunks, malformed requests among them; then the allocator's reserved -
allocated against the start-up fragmentation buffer.

    PYTHONPATH=engine:. python benchmarks/arrivals.py --shape qwen3-0.6b --waves 3 --wave-size 300

Each wave sends all its requests at once and waits for every one to end. A request ends as
served (200 and a finish reason), left (the client closed the stream after two chunks, as
asked), refused (a malformed request answered 400 with a JSON error naming the field, as
asked), rejected (429 or 503 with Retry-After) or lost (anything else; the goal is 0). After
the waves the server is idle and /metrics gives reserved - allocated; the goal is less than the
fragmentation buffer the server measured at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_report, serving_server
from benchmarks import serving_workload as wl
from benchmarks.shapes import SHAPES

MiB = 2**20
CHUNKS_BEFORE_LEAVING = 2
# Malformed bodies and the field each 400 must name (None: the body is not JSON at all).
MALFORMED: tuple[tuple[str, str | None], ...] = (
    ('{"model": "bench", "prompt": "t1 t2", "max_tokens": -3}', "max_tokens"),
    ('{"model": "bench", "prompt": "t1 t2", "temperature": "hot"}', "temperature"),
    ('{"model": "bench", "prompt": [], "max_tokens": 4}', "prompt"),
    ('{"model": "bench", "max_tokens": 4}', "prompt"),
    ('{"model": "bench", "prompt": "t1", "top_p": 7}', "top_p"),
    ('{"model": "bench", "prompt": "t1", "n": 0}', "n"),
    ('{"model": "bench", "prompt": "t1 t2", "stream": tru', None),
)


@dataclass(frozen=True)
class Arrival:
    """One request of a wave: `kind` is "complete", "leave" or "malformed"."""

    kind: str
    body: str  # the JSON text sent
    param: str | None = None  # malformed: the field the 400 must name


def draw_wave(
    rng: random.Random, size: int, vocab_size: int, *, leave_share: float, malformed_share: float
) -> list[Arrival]:
    """`size` arrivals: prompts of 16-1,500 words (one token each), 16-256 tokens asked for."""
    lo, hi = wl.token_id_range(vocab_size)
    wave = []
    for _ in range(size):
        draw = rng.random()
        if draw < malformed_share:
            body, param = rng.choice(MALFORMED)
            wave.append(Arrival("malformed", body, param))
            continue
        prompt = [rng.randrange(lo, hi) for _ in range(rng.randint(16, 1500))]
        kind = "leave" if draw < malformed_share + leave_share else "complete"
        request = wl.completion_body("bench", prompt, rng.randint(16, 256), as_text=True)
        wave.append(Arrival(kind, json.dumps(request)))
    return wave


def outcome(arrival: Arrival, status: int, error: dict[str, Any] | None, finished: bool) -> str:
    """How a request ended, given its HTTP status, its JSON error (if any) and whether its
    stream reached a finish reason or the client left as planned."""
    if status in (429, 503):
        return "rejected"
    if arrival.kind == "malformed":
        named = error is not None and (arrival.param is None or error.get("param") == arrival.param)
        return "refused" if status == 400 and named else "lost"
    if status != 200 or error is not None:
        return "lost"
    if arrival.kind == "leave":
        return "left" if finished else "lost"
    return "served" if finished else "lost"


async def send(session: aiohttp.ClientSession, url: str, arrival: Arrival) -> str:
    headers = {"Content-Type": "application/json"}
    try:
        async with session.post(f"{url}/v1/completions", data=arrival.body, headers=headers) as r:
            if r.status != 200:
                text = await r.text()
                try:
                    error = json.loads(text).get("error") or {}
                except ValueError:
                    error = None
                return outcome(arrival, r.status, error, False)
            num_chunks, finished, error = 0, False, None
            async for raw in r.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    error = event["error"]
                    break
                num_chunks += 1
                if any(c.get("finish_reason") for c in event.get("choices") or []):
                    finished = True
                if arrival.kind == "leave" and num_chunks >= CHUNKS_BEFORE_LEAVING:
                    finished = True
                    break  # leaving the block closes the connection mid-stream
            return outcome(arrival, 200, error, finished)
    except (aiohttp.ClientError, TimeoutError):
        return "lost"


async def run_waves(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    vocab_size = serving_server.model_config(args)["vocab_size"]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    waves = []
    # force_close: a client that leaves drops its connection, as a browser tab does
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for index in range(args.waves):
            wave = draw_wave(
                rng, args.wave_size, vocab_size,
                leave_share=args.leave_share, malformed_share=args.malformed_share,
            )  # fmt: skip
            ends = await asyncio.gather(*(send(session, url, a) for a in wave))
            async with session.get(f"{url}/metrics") as response:
                memory = serving_report.memory_metrics(await response.text())
            waves.append({"wave": index, "outcomes": dict(Counter(ends)), "memory": memory})
            gap_mib = (memory["reserved_minus_allocated_bytes"] or 0) / MiB
            print(f"wave {index}: {dict(Counter(ends))}; reserved - allocated {gap_mib:,.1f} MiB")
    return waves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    add("--model-dir", default=None, help="a checkpoint instead of --shape (gets a tokenizer.json)")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: float32, for smoke runs")
    add("--waves", type=int, default=3)
    add("--wave-size", type=int, default=300)
    add("--leave-share", type=float, default=0.7, help="clients that leave after two chunks")
    add("--malformed-share", type=float, default=0.1)
    add("--seed", type=int, default=0)
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--request-timeout", type=float, default=600.0)
    add("--start-timeout", type=float, default=1200.0)
    add("--engine-arg", action="append", default=[], help="a server argument: --engine-arg=--x")
    add("--json", default=None)
    args = parser.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    settings = wl.EngineSettings(
        args.device, dtype, serving_server.MAX_MODEL_LEN, 256, 16, None,
        args.gpu_memory_utilization, True, False,
    )  # fmt: skip
    # what serving_server.start_server reads of its arguments
    server_args = argparse.Namespace(
        api_server_count=None,
        engine_arg=args.engine_arg,
        start_timeout=args.start_timeout,
        server_cpus=None,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = serving_server.prepare_model_dir(args, Path(tmp))
        log = Path(tmp) / "engine.log"
        server = serving_server.start_server(model_dir, settings, server_args, log)
        try:
            waves = asyncio.run(run_waves(args, server.url))
        finally:
            exit_code = server.stop()
        if exit_code != 0:
            print(server.log_tail())
    memory = waves[-1]["memory"]
    gap, buffer = memory["reserved_minus_allocated_bytes"], memory["fragmentation_buffer_bytes"]
    totals = sum((Counter(w["outcomes"]) for w in waves), Counter())
    report = {"args": vars(args), "waves": waves, "totals": dict(totals), "exit_code": exit_code}
    print(
        f"{args.waves} waves of {args.wave_size}: {dict(totals)}; server exit {exit_code}; "
        f"reserved - allocated after them {(gap or 0) / MiB:,.1f} MiB against the start-up "
        f"buffer of {(buffer or 0) / MiB:,.1f} MiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
