"""W-chat's report (pure): a level's summary from its request records, the /metrics figures,
the offline engine's decode-step time, and the printed lines and table."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving_workload import RequestRecord

# Share of the concurrency that a step must return tokens for to count as a decode step at
# that batch (requests finish and are replaced, so a step seldom serves exactly all of them).
DECODE_BATCH_SHARE = 0.9


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between the closest ranks."""
    assert values, "a percentile of no values"
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ms = [v * 1e3 for v in values_s]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms),
    }


def summarize(records: Sequence[RequestRecord], first_wave: int = 0) -> dict[str, Any]:
    """Rates over the wall time from the first send to the last end; latencies of the requests
    that succeeded; every failure counted by kind, with the first error of each kind kept.

    `first_wave`: a closed loop's first C requests (indexes below it), sent all at once, whose
    prompts queue behind each other; their TTFT and the rest's are also given apart."""
    assert records, "a summary of no requests"
    ok = [r for r in records if r.failure is None]
    failures = Counter(r.failure for r in records if r.failure is not None)
    first_errors: dict[str, str] = {}
    for r in records:
        if r.failure is not None:
            first_errors.setdefault(r.failure, (r.error or "")[:1000])
    wall_s = max(r.end_s for r in records) - min(r.send_s for r in records)
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_events = sum(len(r.chunk_s) for r in ok)  # streamed events that carried text
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "wall_s": wall_s,
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": sum(r.num_cached_tokens for r in ok),
        "num_output_tokens": num_output,
        "num_short": sum(r.num_output_tokens < r.max_tokens for r in ok),
        "output_tok_s": num_output / wall_s,
        "total_tok_s": (num_prompt + num_output) / wall_s,
        "requests_s": len(ok) / wall_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_first_wave_ms": distribution_ms(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.index < first_wave]
        ),
        "ttft_after_first_wave_ms": distribution_ms(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.index >= first_wave]
        ),
        "first_wave": first_wave,
        "itl_ms": distribution_ms([g for r in ok for g in r.inter_token_gaps()]),
        "e2e_ms": distribution_ms([r.end_s - r.send_s for r in ok]),
        "num_itl_exact": sum(r.has_token_counts for r in ok),
        "tokens_per_event": num_output / num_events if num_events else None,
        "failures": dict(failures),
        "first_errors": first_errors,
    }


def memory_metrics(text: str) -> dict[str, float | None]:
    """The allocator and budget figures of a /metrics page (None where the page has none:
    the allocator series exist only on CUDA). Labels other than those named are ignored."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(name: str, **labels: str) -> float | None:
        found = (s.value for s in samples if s.name == name and labels.items() <= s.labels.items())
        return next(found, None)

    reserved = value("pagekeeper_allocator_reserved_bytes")
    allocated = value("pagekeeper_allocator_allocated_bytes")
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_minus_allocated_bytes": (
            None if reserved is None or allocated is None else reserved - allocated
        ),
        "fragmentation_bytes": value("pagekeeper_allocator_fragmentation_bytes"),
        "fragmentation_buffer_bytes": value(
            "pagekeeper_memory_budget_bytes", term="fragmentation_buffer"
        ),
        "num_preemptions": value("vllm:num_preemptions_total"),
    }


@dataclass(frozen=True)
class StepSample:
    """One `engine.step()` call of an offline run."""

    seconds: float
    num_outputs: int  # requests that got tokens back from this call
    num_scheduled_tokens: int  # tokens this call scheduled: one per decode, a chunk per prefill


def decode_step_time(steps: Sequence[StepSample], concurrency: int) -> tuple[float | None, int]:
    """Median seconds of the step calls that ran a pure decode batch at about `concurrency`,
    and how many there were. Kept: calls returning tokens for at least DECODE_BATCH_SHARE of
    `concurrency` requests, where this call and the one before scheduled at most one token per
    running request (no prefill chunk; with asynchronous scheduling a call returns the tokens
    of the step launched by the call before)."""
    kept = [
        step.seconds
        for before, step in itertools.pairwise(steps)
        if before.num_scheduled_tokens <= concurrency
        and step.num_scheduled_tokens <= concurrency
        and step.num_outputs >= DECODE_BATCH_SHARE * concurrency
    ]
    return (statistics.median(kept) if kept else None), len(kept)


def compare(online: dict[str, Any], offline: dict[str, Any]) -> dict[str, float | None]:
    """The level's two targets (docs/benchmarks.md): online / offline output tokens per second
    (goal >= 0.85), and ITL p50 / the offline decode step at that batch (goal <= 1.5)."""
    itl, step = online["itl_ms"]["p50"], offline["decode_step_ms"]
    return {
        "online_over_offline": online["output_tok_s"] / offline["output_tok_s"],
        "itl_p50_over_decode_step": None if itl is None or step is None else itl / step,
    }


def _ms(dist: dict[str, float | None]) -> str:
    return "/".join("-" if dist[k] is None else f"{dist[k]:,.1f}" for k in ("p50", "p90", "p99"))


def _num(value: float | None, fmt: str = ",.0f", scale: float = 1.0) -> str:
    return "-" if value is None else f"{value / scale:{fmt}}"


def format_online(row: dict[str, Any]) -> str:
    s, memory = row["online"], row["memory"]
    failures = ", ".join(f"{n} {kind}" for kind, n in s["failures"].items()) or "none"
    return (
        f"{row['level']:>6} online: {s['num_ok']}/{s['num_requests']} ok in {s['wall_s']:.1f} s,"
        f" {s['output_tok_s']:,.0f} output tok/s; failures: {failures}; {s['num_short']} short;"
        f" {s['num_cached_tokens']:,} of {s['num_prompt_tokens']:,} prompt tokens cached;"
        f" {s['num_itl_exact']} requests timed per token;"
        f" {_num(s.get('tokens_per_event'), '.2f')} tokens per SSE event\n"
        f"        TTFT p50/p90/p99 ms: all"
        f" {_ms(s['ttft_ms'])}, first wave of {s['first_wave']} {_ms(s['ttft_first_wave_ms'])},"
        f" after it {_ms(s['ttft_after_first_wave_ms'])}\n        allocator reserved - allocated"
        f" {_num(memory.get('reserved_minus_allocated_bytes'), ',.1f', 2**20)} MiB (fragmentation"
        f" gauge {_num(memory.get('fragmentation_bytes'), ',.1f', 2**20)} MiB), fragmentation"
        f" buffer {_num(memory.get('fragmentation_buffer_bytes'), ',.1f', 2**20)} MiB,"
        f" preemptions {_num(memory.get('num_preemptions'))}"
        + "".join(
            f"\n        first {kind}: {text[:300]}" for kind, text in s["first_errors"].items()
        )
    )


TABLE_HEAD = (
    "| level | ok | output tok/s | total tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms"
    " | E2E p50/p90/p99 ms | reserved - allocated MiB | offline tok/s | online / offline"
    " | decode step ms | ITL p50 / step |"
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every level in one Markdown table (the allocator column is empty on the CPU)."""
    lines = [TABLE_HEAD, "|---" * TABLE_HEAD.count(" | ") + "|---|"]
    for row in rows:
        s, off = row["online"], row.get("offline", {})
        gap = row["memory"].get("reserved_minus_allocated_bytes")
        cells = [
            row["level"], f"{s['num_ok']}/{s['num_requests']}", _num(s["output_tok_s"]),
            _num(s["total_tok_s"]), _num(s["requests_s"], ".2f"), _ms(s["ttft_ms"]),
            _ms(s["itl_ms"]), _ms(s["e2e_ms"]), _num(gap, ",.1f", 2**20),
            _num(off.get("output_tok_s")), _num(row.get("online_over_offline"), ".0%"),
            _num(off.get("decode_step_ms"), ".2f"),
            _num(row.get("itl_p50_over_decode_step"), ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_offline(row: dict[str, Any]) -> str:
    off, step_ms, step_ratio = row["offline"], row["offline"]["decode_step_ms"], None
    step = "no pure decode step at that batch"
    if step_ms is not None:
        step = f"decode step {step_ms:.2f} ms ({off['num_decode_steps_timed']} steps)"
        step_ratio = row["itl_p50_over_decode_step"]
    return (
        f"{row['level']:>6} offline: {off['output_tok_s']:,.0f} output tok/s in"
        f" {off['seconds']:.1f} s ({off['num_finished']} finished, {off['num_failed']} failed);"
        f" online / offline {row['online_over_offline']:.0%}; {step}"
        + ("" if step_ratio is None else f"; ITL p50 / decode step {step_ratio:.2f}x")
    )
