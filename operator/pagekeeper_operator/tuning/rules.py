"""The recommender (pure): a metric window, the effective policy, the bounds -> proposals.

Each rule reads a few numbers of the window and proposes one field's value, or nothing. A rule
proposes nothing when its evidence is thin (fewer than its minimum samples): "no change" is a
result, not a failure. Every proposal is clipped to `spec.tuning.bounds` and to what the runtime
honours, and dropped if that leaves the value unchanged or the policy invalid. One proposal per
field; the list is ordered by `PRIORITY` (safety before capacity), then confidence.

The rules (derived in docs/memory-policy.md, Tuning):
- prefix-caching-off: hit rate < 0.3 over >= MIN_PREFIX_TOKENS looked-up tokens. At most 30% of
  prompt tokens skip prefill, while every full block of every prompt is hashed and looked up.
- prefix-caching-on: caching off, and >= 30% of prompt tokens repeated an earlier prompt's full
  blocks (the engine's shadow count): that share of prefill would be skipped.
- block-size-down / block-size-up: internal waste w (allocated slots not holding tokens) is
  about (B/2)/mean tokens per sequence, so halving B halves w. Halve when w >= 0.10 and KV is
  the limit (peak usage >= 0.9 or preemptions); double when w < 0.02 and KV is not the limit.
- max-num-seqs-up: the cap binds (running at the cap in >= a quarter of the window, requests
  waiting) with KV peak < 0.8 and no preemption: while it binds, the requests it holds back
  are throughput forgone. KV use grows about linearly with running sequences, so
  cap x 0.9 / peak keeps the peak under 0.9; no more than the demand (the most requests held
  at once, running + waiting peaks: a mean counts the window's idle and draining samples and
  stops short of the offered concurrency), and at most eight times the cap in one step
  (MAX_SEQS_GROWTH).
- max-num-seqs-down: >= 5% of requests preempted with KV peak >= 0.95: the cap admits more than
  the KV holds. New cap: 85% of the mean running count, the concurrency the KV actually held.
- batched-tokens: under ThroughputUnderTTFT with TTFT p99 above its bound and requests waiting,
  double maxNumBatchedTokens (more prompt tokens per step); under ThroughputUnderITL with ITL
  p99 above its bound, halve it (shorter prefill chunks stall decodes less).
- utilization-up: no OOM of any kind, no step-down, KV the limit, and more than 5% of the GPU
  never reserved in the window. A pod has its GPUs to itself, so memory above the budget is
  idle: raise utilization to the ceiling (the bound, 0.95 unset), less a margin (the peak
  reserved - allocated, at least 2% of the GPU, for what the allocator does not count).
- kv-fp8: KV the limit (peak >= 0.95 with preemptions or a queue) and bounds.allowFp8Kv.
- allocator-expandable: >= 2 fragmentation alerts in the window without expandableSegments;
  with them already on, a garbage-collection threshold of 0.8.
- fragmentation-buffer: runtime pagekeeper; the observed reserved - allocated peak above the
  buffer in use (under-provisioned: peak x 1.25), or below half of it with no OOM (gives KV
  memory back: peak x 1.25, at least 256Mi).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.tuning.fields import (
    DEFAULT_MAX_UTILIZATION,
    is_tunable,
    read_field,
    value_text,
    with_change,
)
from pagekeeper_operator.tuning.window import MetricWindow

MIN_REQUESTS = 100
MIN_PREFIX_TOKENS = 50_000
MIN_FRAGMENTATION_ALERTS = 2
PREFIX_HIT_THRESHOLD = 0.3
MIB = 1 << 20
MIN_BUFFER_BYTES = 256 * MIB
# How far one step may raise maxNumSeqs: KV use is extrapolated linearly from the window, so a
# bound keeps one wrong extrapolation from overshooting; 8x takes a cap of 16 to a demand of 128
# in one round.
MAX_SEQS_GROWTH = 8.0
SEQ_CAP_BINDS = 0.25  # share of the window at the cap for max-num-seqs-up
PRIORITY = (
    "allocator-expandable",
    "fragmentation-buffer",
    "max-num-seqs-down",
    "kv-fp8",
    # A binding cap limits throughput by about demand / cap, more than any rule below saves a
    # token (W-tune's chat class: 16 -> 64 sequences gave 3.3x, caching off 1.2x).
    "max-num-seqs-up",
    "prefix-caching-on",
    "prefix-caching-off",
    "block-size-down",
    "batched-tokens",
    "utilization-up",
    "block-size-up",
)


@dataclass(frozen=True)
class Proposal:
    """One field's proposed value and the numbers it rests on."""

    field: str
    current: str
    proposed: str
    rule: str
    evidence: tuple[tuple[str, float], ...]
    expected_effect: str
    confidence: float


@dataclass(frozen=True)
class Context:
    window: MetricWindow
    policy: MemoryPolicy
    tuning: TuningSpec
    runtime: Runtime


Rule = Callable[[Context], Proposal | None]


def _sample_confidence(count: float, minimum: float) -> float:
    """0.5 at the minimum sample count, rising to 1 at four times it."""
    return min(1.0, 0.5 + 0.5 * (count - minimum) / (3 * minimum))


def _proposal(
    ctx: Context,
    field: str,
    value: object,
    rule: str,
    evidence: dict[str, float],
    effect: str,
    confidence: float,
) -> Proposal:
    return Proposal(
        field=field,
        current=read_field(ctx.policy, field),
        proposed=value_text(value),
        rule=rule,
        evidence=tuple((k, round(v, 6)) for k, v in evidence.items()),
        expected_effect=effect,
        confidence=round(max(0.0, min(1.0, confidence)), 3),
    )


def _is_kv_bound(w: MetricWindow, peak: float = 0.9) -> bool:
    return (w.kv_usage_peak or 0.0) >= peak and (
        w.num_preemptions > 0 or (w.waiting_avg or 0.0) >= 1.0
    )


def prefix_caching(ctx: Context) -> Proposal | None:
    w, policy = ctx.window, ctx.policy
    if not ctx.tuning.bounds.allow_prefix_caching_change:
        return None
    if policy.enable_prefix_caching:
        rate = w.prefix_hit_rate
        if w.prefix_queries < MIN_PREFIX_TOKENS or rate is None or rate >= PREFIX_HIT_THRESHOLD:
            return None
        evidence = {"prefixHitRate": rate, "prefixQueryTokens": w.prefix_queries}
        margin = (PREFIX_HIT_THRESHOLD - rate) / PREFIX_HIT_THRESHOLD
        return _proposal(
            ctx, "enablePrefixCaching", False, "prefix-caching-off", evidence,
            f"only {rate:.0%} of looked-up prompt tokens were cached: no hashing or lookups, "
            "and no blocks held for the cache",
            _sample_confidence(w.prefix_queries, MIN_PREFIX_TOKENS) * margin,
        )  # fmt: skip
    shadow = w.prefix_shadow_hits
    if shadow is None or w.prompt_tokens < MIN_PREFIX_TOKENS:
        return None
    share = shadow / w.prompt_tokens
    if share < PREFIX_HIT_THRESHOLD:
        return None
    evidence = {"repeatedPrefixShare": share, "promptTokens": w.prompt_tokens}
    return _proposal(
        ctx, "enablePrefixCaching", True, "prefix-caching-on", evidence,
        f"{share:.0%} of prompt tokens repeat an earlier prompt's blocks: that share of "
        "prefill is skipped, lowering TTFT",
        _sample_confidence(w.prompt_tokens, MIN_PREFIX_TOKENS) * min(1.0, share / 0.6),
    )  # fmt: skip


def block_size(ctx: Context) -> Proposal | None:
    w, size = ctx.window, ctx.policy.block_size
    waste = w.kv_waste_avg
    if waste is None or w.num_requests < MIN_REQUESTS or not w.kv_usage_peak:
        return None
    allowed = set(ctx.tuning.bounds.block_sizes or (8, 16, 32))
    if ctx.runtime == "vllm":
        allowed -= {8}
    evidence = {"kvWaste": waste, "kvUsagePeak": w.kv_usage_peak or 0.0}
    confidence = _sample_confidence(w.num_requests, MIN_REQUESTS)
    if waste >= 0.10 and _is_kv_bound(w) and size // 2 in allowed:
        return _proposal(
            ctx, "blockSize", size // 2, "block-size-down", evidence,
            f"{waste:.0%} of allocated KV slots hold no token; half-size blocks waste about "
            f"{waste / 2:.0%}, so the same memory holds more sequences",
            confidence * min(1.0, waste / 0.2),
        )  # fmt: skip
    if waste < 0.02 and not _is_kv_bound(w) and size * 2 in allowed:
        return _proposal(
            ctx, "blockSize", size * 2, "block-size-up", evidence,
            f"only {waste:.1%} of KV slots are wasted: larger blocks halve the block tables "
            f"at about {waste * 2:.1%} waste",
            confidence * 0.6,
        )  # fmt: skip
    return None


def _clip_int(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def max_num_seqs(ctx: Context) -> Proposal | None:
    w, policy, bounds = ctx.window, ctx.policy, ctx.tuning.bounds.max_num_seqs
    cap = policy.max_num_seqs
    low, high = (bounds.min, bounds.max) if bounds else (1, policy.max_num_batched_tokens)
    high = min(high, policy.max_num_batched_tokens)
    if w.num_requests < MIN_REQUESTS or w.kv_usage_peak is None:
        return None
    peak = w.kv_usage_peak
    if w.preemptions_per_request >= 0.05 and peak >= 0.95 and w.running_avg is not None:
        new = _clip_int(int(min(cap, w.running_avg) * 0.85), low, high)
        evidence = {"preemptionsPerRequest": w.preemptions_per_request, "kvUsagePeak": peak,
                    "runningAvg": w.running_avg}  # fmt: skip
        return _proposal(
            ctx, "maxNumSeqs", new, "max-num-seqs-down", evidence,
            f"{w.preemptions_per_request:.0%} of requests were preempted: a cap the KV cache "
            "holds ends the recomputation",
            _sample_confidence(w.num_requests, MIN_REQUESTS),
        )  # fmt: skip
    binds = w.seq_cap_fraction or 0.0
    if (
        binds >= SEQ_CAP_BINDS
        and (w.waiting_avg or 0.0) >= 1.0
        and peak < 0.8
        and w.num_preemptions == 0
    ):
        if w.running_peak is not None and w.waiting_peak is not None:
            demand = w.running_peak + w.waiting_peak
        else:  # a window without the peaks (an older runtime's series)
            demand = (w.running_avg or float(cap)) + (w.waiting_avg or 0.0)
        new = _clip_int(
            int(min(cap * MAX_SEQS_GROWTH, cap * 0.9 / max(peak, 0.01), demand)), low, high
        )
        if new <= cap:  # the demand or the bounds leave no room above the cap
            return None
        evidence = {"seqCapFraction": binds, "kvUsagePeak": peak,
                    "waitingAvg": w.waiting_avg or 0.0, "demand": demand}  # fmt: skip
        return _proposal(
            ctx, "maxNumSeqs", new, "max-num-seqs-up", evidence,
            f"the cap held requests waiting while KV peaked at {peak:.0%}: more run at once, "
            "KV peak near 90%",
            _sample_confidence(w.num_requests, MIN_REQUESTS) * binds,
        )  # fmt: skip
    return None


def batched_tokens(ctx: Context) -> Proposal | None:
    w, policy, tuning = ctx.window, ctx.policy, ctx.tuning
    tokens = policy.max_num_batched_tokens
    bounds = tuning.bounds.max_num_batched_tokens
    low, high = (bounds.min, bounds.max) if bounds else (1, 1_048_576)
    low = max(low, policy.max_num_seqs)
    if w.num_requests < MIN_REQUESTS:
        return None
    confidence = _sample_confidence(w.num_requests, MIN_REQUESTS)
    ttft, itl = w.ttft_p99, w.itl_p99
    if tuning.objective == "ThroughputUnderTTFT" and ttft is not None and w.num_ooms == 0:
        limit = tuning.ttft_p99_seconds or math.inf
        if ttft > limit and (w.waiting_avg or 0.0) >= 1.0:
            evidence = {"ttftP99Seconds": ttft, "boundSeconds": limit}
            return _proposal(
                ctx, "maxNumBatchedTokens", _clip_int(tokens * 2, low, high), "batched-tokens",
                evidence, "twice the prompt tokens per step: queued prompts start sooner (TTFT "
                "down), each step longer (ITL up)", confidence,
            )  # fmt: skip
    if tuning.objective == "ThroughputUnderITL" and itl is not None:
        limit = tuning.itl_p99_seconds or math.inf
        if itl > limit:
            evidence = {"itlP99Seconds": itl, "boundSeconds": limit}
            return _proposal(
                ctx, "maxNumBatchedTokens", _clip_int(tokens // 2, low, high), "batched-tokens",
                evidence, "half the prompt tokens per step: a prefill chunk stalls the running "
                "decodes half as long (ITL down, TTFT up)", confidence,
            )  # fmt: skip
    return None


def utilization(ctx: Context) -> Proposal | None:
    w, policy = ctx.window, ctx.policy
    total, reserved = w.gpu_total_bytes, w.reserved_peak_bytes
    if policy.gpu_memory_utilization is None:  # a KV byte budget: no fraction to raise
        return None
    if total is None or reserved is None or w.num_requests < MIN_REQUESTS:
        return None
    if w.num_ooms > 0 or w.is_stepped_down or not _is_kv_bound(w):
        return None
    idle = (total - reserved) / total
    if idle <= 0.05:
        return None
    margin = max((w.fragmentation_peak_bytes or 0.0) / total, 0.02)
    bounds = ctx.tuning.bounds.gpu_memory_utilization
    high = bounds.max if bounds else DEFAULT_MAX_UTILIZATION
    new = min(high, math.floor((1.0 - margin) * 100) / 100)
    if new <= policy.gpu_memory_utilization:
        return None
    evidence = {"reservedPeakGiB": reserved / 2**30, "gpuTotalGiB": total / 2**30,
                "idleFraction": idle, "oomEvents": 0.0}  # fmt: skip
    return _proposal(
        ctx, "gpuMemoryUtilization", new, "utilization-up", evidence,
        f"{idle:.0%} of the GPU was never reserved while KV was the limit and nothing ran out "
        f"of memory: at {new:g} that memory becomes KV cache",
        _sample_confidence(w.num_requests, MIN_REQUESTS) * min(1.0, idle / 0.1),
    )  # fmt: skip


def kv_fp8(ctx: Context) -> Proposal | None:
    w = ctx.window
    if not ctx.tuning.bounds.allow_fp8_kv or ctx.policy.kv_cache_dtype == "fp8":
        return None
    if w.num_requests < MIN_REQUESTS or not _is_kv_bound(w, peak=0.95):
        return None
    evidence = {"kvUsagePeak": w.kv_usage_peak or 0.0, "preemptions": w.num_preemptions,
                "waitingAvg": w.waiting_avg or 0.0}  # fmt: skip
    return _proposal(
        ctx, "kvCacheDtype", "fp8", "kv-fp8", evidence,
        "one byte per key and value: about twice the tokens in the same KV memory, at a small "
        "cost in accuracy",
        _sample_confidence(w.num_requests, MIN_REQUESTS),
    )  # fmt: skip


def allocator(ctx: Context) -> Proposal | None:
    w, options = ctx.window, ctx.policy.allocator
    alerts = w.num_fragmentation_alerts
    if not ctx.tuning.bounds.allow_allocator_change or alerts < MIN_FRAGMENTATION_ALERTS:
        return None
    evidence = {"fragmentationAlerts": float(alerts),
                "fragmentationPeakGiB": (w.fragmentation_peak_bytes or 0.0) / 2**30}  # fmt: skip
    confidence = min(1.0, alerts / 4)
    if not options.expandable_segments:
        return _proposal(
            ctx, "allocator.expandableSegments", True, "allocator-expandable", evidence,
            "segments grow in place instead of new fixed-size ones: reserved - allocated "
            "stays low as batch shapes vary", confidence,
        )  # fmt: skip
    if options.garbage_collection_threshold is None:
        return _proposal(
            ctx, "allocator.garbageCollectionThreshold", 0.8, "allocator-expandable", evidence,
            "cached blocks not in use are released once reserved passes 80% of the allowed "
            "memory", confidence * 0.7,
        )  # fmt: skip
    return None


def fragmentation_buffer(ctx: Context) -> Proposal | None:
    w = ctx.window
    peak, buffer = w.fragmentation_peak_bytes, w.fragmentation_buffer_bytes
    if not ctx.tuning.bounds.allow_fragmentation_buffer_change or peak is None or buffer is None:
        return None
    if w.num_requests < MIN_REQUESTS:
        return None
    target = max(MIN_BUFFER_BYTES, math.ceil(peak * 1.25 / MIB) * MIB)
    evidence = {"fragmentationPeakMiB": peak / MIB, "bufferMiB": buffer / MIB}
    confidence = _sample_confidence(w.num_requests, MIN_REQUESTS)
    if peak > buffer:
        effect = "the buffer covers the observed peak with a quarter to spare: fewer OOMs"
    elif peak < buffer / 2 and w.num_ooms == 0 and target < buffer:
        effect = f"{(buffer - target) / MIB:.0f} MiB kept back for fragmentation become KV cache"
        confidence *= 0.8
    else:
        return None
    return _proposal(
        ctx, "fragmentationBuffer", f"{target // MIB}Mi", "fragmentation-buffer", evidence,
        effect, confidence,
    )  # fmt: skip


RULES: tuple[Rule, ...] = (
    allocator, fragmentation_buffer, max_num_seqs, kv_fp8, prefix_caching, block_size,
    batched_tokens, utilization,
)  # fmt: skip


def recommend(
    window: MetricWindow,
    policy: MemoryPolicy,
    tuning: TuningSpec,
    runtime: Runtime,
    held_fields: Collection[str] = (),
) -> list[Proposal]:
    """Proposals for `policy` (the effective one) from `window`, best first; fields in
    `held_fields` (hold-offs, a trial under way) are never proposed."""
    policy = policy.with_budget_resolved()
    ctx = Context(window, policy, tuning, runtime)
    proposals: dict[str, Proposal] = {}
    for rule in RULES:
        proposal = rule(ctx)
        if proposal is None or proposal.field in held_fields or proposal.field in proposals:
            continue
        if not is_tunable(proposal.field, runtime) or proposal.proposed == proposal.current:
            continue
        try:
            with_change(policy, proposal.field, proposal.proposed)
        except ValueError:
            continue  # the CRD's own rules refuse it (e.g. maxNumSeqs above the token budget)
        proposals[proposal.field] = proposal
    return sorted(proposals.values(), key=lambda p: (PRIORITY.index(p.rule), -p.confidence))
