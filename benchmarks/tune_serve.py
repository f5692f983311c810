"""W-tune's rounds over real engines: one policy served through HTTP (`serving.py`'s server and
clients), its /metrics and the clients' records read into the operator's metric window and the
trial rule's samples (throughput and the secondary figures), the window saved as a rule-test
fixture on request."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import serving_client, serving_report, serving_server
from benchmarks import serving_workload as wl
from benchmarks import tune_trial as tt
from benchmarks import tune_workload as tw
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.policy.effective import allocator_conf
from pagekeeper_operator.render.engine import ALLOC_CONF_ENV, policy_flags
from pagekeeper_operator.tuning.window import MetricWindow

# serve(policy, tag) -> (the round's result, its window or None)
Serve = Callable[[MemoryPolicy, str], tuple[dict[str, Any], MetricWindow | None]]


def settings_of(policy: MemoryPolicy, args: argparse.Namespace) -> wl.EngineSettings:
    utilization = policy.effective_utilization
    assert utilization is not None, "W-tune's policies budget by utilization, not kvCacheMemory"
    return wl.EngineSettings(
        args.device, "bfloat16" if args.device == "cuda" else "float32", args.max_model_len,
        policy.max_num_seqs, policy.block_size, policy.max_num_batched_tokens,
        utilization, policy.enable_prefix_caching, args.enforce_eager,
    )  # fmt: skip


class Sampler:
    """Reads /metrics every `interval` seconds from a thread until stopped."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url, interval
        self.scrapes: list[tuple[float, tw.Scrape]] = []  # (time.monotonic(), reading)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            status, text = serving_server.http_get(f"{self.url}/metrics")
            if status == 200:
                self.scrapes.append((time.monotonic(), tw.Scrape.parse(text)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def open_loop_plans(
    url: str, cls: tw.WorkloadClass, args: argparse.Namespace
) -> list[wl.ClientPlan]:
    num = max(1, args.client_processes)
    arrivals = list(enumerate(cls.arrivals))
    return [
        wl.ClientPlan(
            url=url,
            model=serving_server.MODEL_NAME,
            prompts=cls.work.prompts,
            output_lens=cls.work.output_lens,
            warmup=[],
            num_streams=0,
            arrivals=arrivals[w::num],
            timeout_s=args.request_timeout,
        )
        for w in range(num)
    ]


def readings_of(
    timed: list[tuple[float, tw.Scrape]], name: str = "vllm:generation_tokens_total"
) -> list[tt.Reading]:
    return [tt.Reading(t, value) for t, scrape in timed if (value := scrape.get(name)) is not None]


def scrape_text(url: str, args: argparse.Namespace, log: Path, when: str) -> str:
    """The engine's /metrics text; under `--metrics-dir` also saved there as `<round>.<when>.prom`
    (every series the engine exports, beyond what the window reads)."""
    text = serving_server.http_get(f"{url}/metrics")[1]
    if args.metrics_dir is not None:
        directory = Path(args.metrics_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{log.stem}.{when}.prom").write_text(text)
    return text


def serve_round(
    model_dir: Path,
    cls: tw.WorkloadClass,
    policy: MemoryPolicy,
    args: argparse.Namespace,
    log: Path,
) -> dict[str, Any]:
    """One round: the engine at `policy`, the class's requests, the window, the trial rule's
    figures and the summary."""
    run_args = argparse.Namespace(**vars(args))
    run_args.engine_arg = [*args.engine_arg, *policy_flags(policy, is_pagekeeper=True)]
    for name in ALLOC_CONF_ENV:  # the operator puts the allocator options in the pod's env
        os.environ[name] = allocator_conf(policy.allocator)
    try:
        server = serving_server.start_server(model_dir, settings_of(policy, args), run_args, log)
    except RuntimeError as exc:  # a policy that cannot start (a start-up OOM) is a result too
        return {"policy": policy.to_api(), "error": str(exc)[-2000:]}
    try:
        before_s = time.monotonic()
        before = tw.Scrape.parse(scrape_text(server.url, args, log, "before"))
        started = time.monotonic()
        with Sampler(server.url, args.sample_interval) as sampler:
            if cls.concurrency is not None:
                # No warm-up: the engine warmed up at start, and the window counts every request.
                warm = wl.ChatWorkload([], [])
                level = wl.Level(concurrency=cls.concurrency)
                records = serving_client.run_online(server.url, level, (cls.work, warm), run_args)
            else:
                records = serving_client.run_plans(open_loop_plans(server.url, cls, args))
        seconds = time.monotonic() - started
        after = tw.Scrape.parse(scrape_text(server.url, args, log, "after"))
        after_s = time.monotonic()
    finally:
        code = server.stop()
    scrapes = [s for _, s in sampler.scrapes]
    window = tw.window_of(before, after, scrapes, records, seconds, policy.max_num_seqs)
    timed = [(before_s, before), *sampler.scrapes, (after_s, after)]
    span = tt.steady_span(records, cls.concurrency is not None)
    secondary = tt.secondary_samples(
        records, readings_of(timed, "vllm:num_preemptions_total"),
        readings_of(timed, "vllm:request_success_total"), tt.stretch_edges(*span),
    )  # fmt: skip
    figures = tt.RoundFigures(
        tt.throughput_samples(readings_of(timed), *span), window.ttft_p99, window.itl_p99,
        secondary,
    )  # fmt: skip
    summary = serving_report.summarize(records)
    return {
        "policy": policy.to_api(),
        "window": window,
        "figures": dataclasses.asdict(figures),
        "output_tok_s": summary["output_tok_s"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_p99_ms": summary["itl_ms"]["p99"],
        "preemptions": window.num_preemptions,
        "ooms": window.num_ooms,
        "reserved_minus_allocated_peak_mib": (
            None
            if window.fragmentation_peak_bytes is None
            else window.fragmentation_peak_bytes / 2**20
        ),
        "failures": summary["failures"],
        "exit_code": code,
        "start_s": server.start_s,  # the engine's start, spawn to ready
        "serve_s": seconds,
    }


def serving(model_dir: Path, cls: tw.WorkloadClass, args: argparse.Namespace, tmp: Path) -> Serve:
    """`serve` over real engines: each round's log in `tmp`, its window saved as a fixture
    under `--fixtures`."""

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        result = serve_round(model_dir, cls, policy, args, tmp / f"{tag}.log")
        window = result.pop("window", None)
        if window is not None and args.fixtures is not None:
            save_fixture(Path(args.fixtures), tag, window, cls, result)
        return result, window

    return serve


def save_fixture(
    directory: Path, name: str, window: MetricWindow, cls: tw.WorkloadClass, result: dict[str, Any]
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = json.loads(window.to_json())
    data["note"] = f"W-tune {cls.name}, policy {json.dumps(result['policy'], sort_keys=True)}"
    (directory / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
