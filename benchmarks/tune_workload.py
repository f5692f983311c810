"""W-tune's pure parts (docs/benchmarks.md, W-tune): the four workload classes, their poor starting
policies and grids, and a metric window from the engine's /metrics read during a round.

The window is the operator's `tuning.window.MetricWindow`, so the recommender sees on the GPU
exactly what it sees from Prometheus in a cluster, and each round's window can be saved as a
fixture for the rule tests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving_report import percentile
from benchmarks.serving_workload import ChatWorkload, RequestRecord, token_id_range
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.tuning.window import MetricWindow

RAG_PREFIXES = 8
RAG_PREFIX_LEN = 2048
BURST_SIZE = 64
BURST_EVERY_S = 20.0
# The burst class's objective: its arrivals are open loop, so every policy that keeps up serves
# the same tokens, and what a poor one loses is the bursts' time to first token.
BURST_TTFT_P99_S = 2.0
# The long-output class's streams: under the engine's default cap of 256 sequences, so only
# memory limits how many run (no sequence-cap rule applies).
LONGOUT_STREAMS = 192


@dataclass(frozen=True)
class WorkloadClass:
    """One W-tune class: its requests (closed loop at `concurrency`, or open-loop `arrivals`),
    the deliberately poor policy it starts from, the grid beside the rounds (never the start:
    each point is served anew) and the objective (`spec.tuning`'s) both are scored under."""

    name: str
    work: ChatWorkload
    concurrency: int | None  # closed loop; None: open loop at `arrivals`
    arrivals: list[float]  # seconds after the start, one per request (open loop)
    start: MemoryPolicy
    grid: list[MemoryPolicy]
    why: str
    tuning: TuningSpec = field(default_factory=TuningSpec)


def _ids(rng: random.Random, lo: int, hi: int, n: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def chat(num_requests: int, seed: int, vocab_size: int, scale: float = 1.0) -> ChatWorkload:
    """Prompts uniform 64-512 tokens, outputs 32-256 (`scale` shrinks both for smoke runs)."""
    rng = random.Random(f"{seed}-chat")
    lo, hi = token_id_range(vocab_size)
    prompts = [
        _ids(rng, lo, hi, rng.randint(64, max(64, int(512 * scale)))) for _ in range(num_requests)
    ]
    outputs = [
        rng.randint(min(32, int(256 * scale)), max(1, int(256 * scale)))
        for _ in range(num_requests)
    ]
    return ChatWorkload(prompts, outputs)


def rag(num_requests: int, seed: int, vocab_size: int, scale: float = 1.0) -> ChatWorkload:
    """RAG_PREFIXES shared prefixes of RAG_PREFIX_LEN tokens; each request one of them plus a
    unique context log-uniform in 32-4,096 tokens; outputs 64-256."""
    rng = random.Random(f"{seed}-rag")
    lo, hi = token_id_range(vocab_size)
    prefix_len = max(16, int(RAG_PREFIX_LEN * scale))
    prefixes = [_ids(rng, lo, hi, prefix_len) for _ in range(RAG_PREFIXES)]
    top = max(33, int(4096 * scale))
    prompts, outputs = [], []
    for _ in range(num_requests):
        context = int(math.exp(rng.uniform(math.log(32), math.log(top))))
        prompts.append(rng.choice(prefixes) + _ids(rng, lo, hi, context))
        outputs.append(rng.randint(max(1, int(64 * scale)), max(1, int(256 * scale))))
    return ChatWorkload(prompts, outputs)


def long_outputs(num_requests: int, seed: int, vocab_size: int, scale: float = 1.0) -> ChatWorkload:
    """Prompts uniform 16-64 tokens, outputs 256-768: decode-bound streams whose KV grows with
    each token, so a small budget preempts and recomputes them."""
    rng = random.Random(f"{seed}-longout")
    lo, hi = token_id_range(vocab_size)
    prompts = [_ids(rng, lo, hi, rng.randint(16, 64)) for _ in range(num_requests)]
    outputs = [
        rng.randint(max(1, int(256 * scale)), max(1, int(768 * scale))) for _ in range(num_requests)
    ]
    return ChatWorkload(prompts, outputs)


def burst(
    duration_s: float, seed: int, vocab_size: int, scale: float = 1.0, background_rate: float = 8.0
) -> tuple[ChatWorkload, list[float]]:
    """A chat background on Poisson arrivals (`background_rate`/s, about 16 in flight on an
    H200 with the 0.6B shape) plus, every BURST_EVERY_S, BURST_SIZE simultaneous prompts of
    3,000-6,000 tokens; sorted by arrival."""
    rng = random.Random(f"{seed}-burst")
    lo, hi = token_id_range(vocab_size)
    background = chat(int(duration_s * background_rate) + 1, seed, vocab_size, scale)
    times = [0.0]
    while len(times) < len(background.prompts):
        times.append(times[-1] + rng.expovariate(background_rate))
    entries = list(zip(times, background.prompts, background.output_lens, strict=True))
    start = 0.0
    while start < duration_s:
        for _ in range(BURST_SIZE):
            n = rng.randint(max(1, int(3000 * scale)), max(1, int(6000 * scale)))
            entries.append((start, _ids(rng, lo, hi, n), rng.randint(16, max(16, int(64 * scale)))))
        start += BURST_EVERY_S
    entries = [e for e in entries if e[0] < duration_s]
    entries.sort(key=lambda e: e[0])
    work = ChatWorkload([e[1] for e in entries], [e[2] for e in entries])
    return work, [e[0] for e in entries]


def policy(**fields: Any) -> MemoryPolicy:
    return MemoryPolicy.model_validate(fields)


def classes(
    seed: int, vocab_size: int, max_model_len: int, *, quick: bool, scale: float = 1.0
) -> list[WorkloadClass]:
    """The four classes, each from a stated poor policy, with a coarse grid over the knobs the
    recommender may move for it."""
    n = 512 if quick else 1024
    base = {"maxModelLen": max_model_len}
    burst_work, arrivals = burst(30.0 if quick else 120.0, seed, vocab_size, scale)
    burst_base = {**base, "maxNumBatchedTokens": 16384}
    return [
        WorkloadClass(
            "chat", chat(n, seed, vocab_size, scale), 128, [],
            policy(**base, maxNumSeqs=16),
            [policy(**base, maxNumSeqs=s) for s in (64, 128, 256)],
            "maxNumSeqs 16 leaves most of the 128 streams waiting",
        ),
        WorkloadClass(
            "rag", rag(n * 3 // 4, seed, vocab_size, scale), 64, [],
            policy(**base, enablePrefixCaching=False, blockSize=32),
            [policy(**base, enablePrefixCaching=c, blockSize=b)
             for c, b in ((False, 16), (True, 16), (True, 32))],
            "prefix caching off while every prompt starts with one of 8 shared 2,048-token "
            "prefixes; 32-token blocks (the contexts behind the prefixes are 32 to 4,096 "
            "tokens, so the grid also shows whether block size matters here)",
        ),
        WorkloadClass(
            "burst", burst_work, None, arrivals,
            policy(**burst_base, gpuMemoryUtilization=0.1),
            [policy(**burst_base, gpuMemoryUtilization=u) for u in (0.3, 0.9)],
            "utilization 0.1 (a budget sized for a shared GPU) holds about a third of one "
            "burst's 64 long prompts in KV, so the rest queue",
            TuningSpec.model_validate(
                {"objective": "ThroughputUnderTTFT", "ttftP99Seconds": BURST_TTFT_P99_S}
            ),
        ),
        WorkloadClass(
            "longout", long_outputs(n * 3 // 4, seed, vocab_size, scale), LONGOUT_STREAMS, [],
            policy(**base, gpuMemoryUtilization=0.1),
            [policy(**base, gpuMemoryUtilization=u) for u in (0.3, 0.9)],
            f"utilization 0.1 holds a fraction of {LONGOUT_STREAMS} streams' growing outputs in "
            "KV, so they are preempted and recomputed, and the queued ones wait for their "
            "first token",
        ),
    ]  # fmt: skip


@dataclass
class Scrape:
    """One /metrics reading: sample name + sorted labels -> value."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        scrape = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                scrape.values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return scrape

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of `name`'s samples whose labels include `labels` (None: no sample)."""
        found = [
            v
            for (n, ls), v in self.values.items()
            if n == name and labels.items() <= dict(ls).items()
        ]
        return sum(found) if found else None


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float | None:
    end = after.get(name, **labels)
    return None if end is None else end - (before.get(name, **labels) or 0.0)


def window_of(
    before: Scrape,
    after: Scrape,
    during: Sequence[Scrape],
    records: Sequence[RequestRecord],
    seconds: float,
    max_num_seqs: int,
) -> MetricWindow:
    """The round's window: counters as after - before, gauges over the readings during it,
    TTFT and ITL p99 from the clients' records (what the histograms would give)."""
    samples = [*during, after] if during else [after]

    def gauge(name: str) -> list[float]:
        return [v for s in samples if (v := s.get(name)) is not None]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    kv, waiting = gauge("vllm:kv_cache_usage_perc"), gauge("vllm:num_requests_waiting")
    running = gauge("vllm:num_requests_running")
    waste = [  # while blocks are in use, as the operator's query reads it
        v
        for s in samples
        if (v := s.get("pagekeeper_kv_internal_fragmentation_ratio")) is not None
        and (s.get("vllm:kv_cache_usage_perc") or 0.0) > 0
    ]
    reserved, frag = (
        gauge("pagekeeper_allocator_reserved_bytes"),
        gauge("pagekeeper_allocator_fragmentation_bytes"),
    )
    ok = [r for r in records if r.failure is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.inter_token_gaps()]
    ooms = {kind: _delta(before, after, "pagekeeper_oom_events_total", kind=kind) or 0.0
            for kind in ("step", "swap", "startup")}  # fmt: skip
    return MetricWindow(
        seconds=seconds,
        num_requests=_delta(before, after, "vllm:request_success_total") or 0.0,
        output_tokens_per_s=(_delta(before, after, "vllm:generation_tokens_total") or 0.0)
        / seconds,
        prompt_tokens=_delta(before, after, "vllm:prompt_tokens_total") or 0.0,
        kv_usage_avg=mean(kv),
        kv_usage_peak=max(kv) if kv else None,
        num_preemptions=_delta(before, after, "vllm:num_preemptions_total") or 0.0,
        waiting_avg=mean(waiting),
        waiting_peak=max(waiting) if waiting else None,
        running_avg=mean(running),
        running_peak=max(running) if running else None,
        seq_cap_fraction=mean([float(r >= max_num_seqs) for r in running]),
        prefix_queries=_delta(before, after, "vllm:prefix_cache_queries_total") or 0.0,
        prefix_hits=_delta(before, after, "vllm:prefix_cache_hits_total") or 0.0,
        prefix_shadow_hits=_delta(before, after, "pagekeeper_prefix_cache_shadow_hits_total"),
        kv_waste_avg=mean(waste),
        reserved_peak_bytes=max(reserved) if reserved else None,
        fragmentation_peak_bytes=max(frag) if frag else None,
        num_oom_step=ooms["step"],
        num_oom_swap=ooms["swap"],
        num_oom_startup=ooms["startup"],
        ttft_p99=percentile(ttfts, 99) if ttfts else None,
        itl_p99=percentile(gaps, 99) if gaps else None,
        gpu_total_bytes=after.get("pagekeeper_memory_budget_bytes", term="total", rank="0"),
        budget_allowed_bytes=after.get("pagekeeper_memory_budget_bytes", term="allowed", rank="0"),
        fragmentation_buffer_bytes=after.get(
            "pagekeeper_memory_budget_bytes", term="fragmentation_buffer", rank="0"
        ),
    )
