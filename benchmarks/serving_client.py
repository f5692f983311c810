"""W-chat's client side: streaming (or whole-body) completions over HTTP from spawned client
processes, closed loop (C streams in flight across the processes) or on seeded arrivals. The
client processes never import torch."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any

import aiohttp

from benchmarks import serving_workload as wl
from benchmarks.serving_server import parse_cpus


async def stream_completion(
    session: aiohttp.ClientSession, plan: wl.ClientPlan, index: int, prompt: list[int], n: int
) -> wl.RequestRecord:
    body = wl.completion_body(plan.model, prompt, n, stream=plan.stream, as_text=plan.as_text)
    record = wl.RequestRecord(index, n, send_s=time.monotonic())
    try:
        async with session.post(f"{plan.url}/v1/completions", json=body) as response:
            record.status = response.status
            if response.status != 200:
                record.error = await response.text()
            elif not plan.stream:
                text = await response.text()
                record.end_s = time.monotonic()
                record.on_body(text)
            else:
                async for line in response.content:
                    if line.startswith(b"data: "):
                        record.on_event(line[6:].decode().strip(), time.monotonic())
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_s = record.end_s or time.monotonic()
    return record


async def run_client(
    worker: int, plan: wl.ClientPlan, next_index: Any, go: Any, messages: Any
) -> list[wl.RequestRecord]:
    connector = aiohttp.TCPConnector(limit=0)  # the default limit (100) would cap concurrency
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=plan.timeout_s)
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else None
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        warm_ups = (stream_completion(session, plan, -1, p, n) for p, n in plan.warmup)
        warm = await asyncio.gather(*warm_ups)
        if failed := [r for r in warm if r.failure is not None]:
            raise RuntimeError(f"a warm-up request failed ({failed[0].failure}): {failed[0].error}")
        messages.put(("ready", worker, None))
        go.wait()  # blocks the loop, which has nothing else to do until the start

        async def closed_stream() -> list[wl.RequestRecord]:
            records: list[wl.RequestRecord] = []
            while True:
                with next_index.get_lock():  # one counter for all processes: C in flight in all
                    index = next_index.value
                    next_index.value += 1
                if index >= len(plan.prompts):
                    return records
                prompt, n = plan.prompts[index], plan.output_lens[index]
                records.append(await stream_completion(session, plan, index, prompt, n))

        async def at(index: int, offset_s: float) -> wl.RequestRecord:
            await asyncio.sleep(max(0.0, start + offset_s - time.monotonic()))
            prompt, n = plan.prompts[index], plan.output_lens[index]
            return await stream_completion(session, plan, index, prompt, n)

        start = time.monotonic()
        if plan.num_streams:
            streams = await asyncio.gather(*(closed_stream() for _ in range(plan.num_streams)))
            return [record for records in streams for record in records]
        return list(await asyncio.gather(*(at(i, t) for i, t in plan.arrivals)))


def client_process(
    worker: int, plan: wl.ClientPlan, next_index: Any, go: Any, messages: Any
) -> None:
    if plan.cpus:
        os.sched_setaffinity(0, plan.cpus)
    try:
        records = asyncio.run(run_client(worker, plan, next_index, go, messages))
    except Exception:  # handed to the parent, which fails the run with it
        messages.put(("failed", worker, traceback.format_exc()))
    else:
        messages.put(("done", worker, records))


def collect(procs: list[Any], messages: Any, kind: str) -> list[Any]:
    """One `kind` message from every client process, in process order; a failure raises."""
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            message, worker, payload = messages.get(timeout=1.0)
        except queue.Empty:
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process died (exit codes {dead})") from None
            continue
        if message == "failed":
            raise RuntimeError(f"client process {worker} failed:\n{payload}")
        assert message == kind, f"expected {kind!r} from client {worker}, got {message!r}"
        got[worker] = payload
    return [got[w] for w in sorted(got)]


def run_online(
    url: str, level: wl.Level, requests: wl.LevelRequests, args: argparse.Namespace
) -> list[wl.RequestRecord]:
    """One level through the server from `--client-processes` spawned processes."""
    plans = wl.client_plans(
        level, requests, args.seed, url=url, model=args.model_name,
        timeout_s=args.request_timeout, num_processes=args.client_processes,
        as_text=args.prompt_format == "text", cpus=parse_cpus(args.client_cpus),
        api_key=getattr(args, "api_key", None),
    )  # fmt: skip
    return run_plans(plans)


def run_plans(plans: list[wl.ClientPlan]) -> list[wl.RequestRecord]:
    """Each plan in its own spawned client process, all started together after their warm-ups;
    the plans index one shared request counter (closed loop) or their own arrivals."""
    ctx = mp.get_context("spawn")
    next_index, go, messages = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=client_process, args=(w, plan, next_index, go, messages))
        for w, plan in enumerate(plans)
    ]
    for proc in procs:
        proc.start()
    try:
        collect(procs, messages, "ready")
        go.set()
        records = [r for rs in collect(procs, messages, "done") for r in rs]
    finally:
        for proc in procs:
            if proc.is_alive():  # only after a failure: a done process exits by itself
                proc.terminate()
            proc.join()
    return sorted(records, key=lambda r: r.index)
