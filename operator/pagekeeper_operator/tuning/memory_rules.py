"""The recommender's rules over memory readings (pure): the budget, the KV cache's dtype, the
allocator and the fragmentation buffer. `rules` runs them beside the scheduling rules; the
conventions (evidence, confidence, clipping to bounds) are the same, and docs/memory-policy.md,
Tuning, derives each.

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

from pagekeeper_operator.policy.fields import DEFAULT_MAX_UTILIZATION
from pagekeeper_operator.tuning.proposal import (
    MIN_REQUESTS,
    Context,
    Proposal,
    is_kv_bound,
    propose,
    sample_confidence,
)

MIN_FRAGMENTATION_ALERTS = 2
MIB = 1 << 20
MIN_BUFFER_BYTES = 256 * MIB


def utilization(ctx: Context) -> Proposal | None:
    w, policy = ctx.window, ctx.policy
    total, reserved = w.gpu_total_bytes, w.reserved_peak_bytes
    if policy.gpu_memory_utilization is None:  # a KV byte budget: no fraction to raise
        return None
    if total is None or reserved is None or w.num_requests < MIN_REQUESTS:
        return None
    if w.num_ooms > 0 or w.is_stepped_down or not is_kv_bound(w):
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
    return propose(
        ctx, "gpuMemoryUtilization", new, "utilization-up", evidence,
        f"{idle:.0%} of the GPU was never reserved while KV was the limit and nothing ran out "
        f"of memory: at {new:g} that memory becomes KV cache",
        sample_confidence(w.num_requests, MIN_REQUESTS) * min(1.0, idle / 0.1),
    )  # fmt: skip


def kv_fp8(ctx: Context) -> Proposal | None:
    w = ctx.window
    if not ctx.tuning.bounds.allow_fp8_kv or ctx.policy.kv_cache_dtype == "fp8":
        return None
    if w.num_requests < MIN_REQUESTS or not is_kv_bound(w, peak=0.95):
        return None
    evidence = {"kvUsagePeak": w.kv_usage_peak or 0.0, "preemptions": w.num_preemptions,
                "waitingAvg": w.waiting_avg or 0.0}  # fmt: skip
    return propose(
        ctx, "kvCacheDtype", "fp8", "kv-fp8", evidence,
        "one byte per key and value: about twice the tokens in the same KV memory, at a small "
        "cost in accuracy",
        sample_confidence(w.num_requests, MIN_REQUESTS),
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
        return propose(
            ctx, "allocator.expandableSegments", True, "allocator-expandable", evidence,
            "segments grow in place instead of new fixed-size ones: reserved - allocated "
            "stays low as batch shapes vary", confidence,
        )  # fmt: skip
    if options.garbage_collection_threshold is None:
        return propose(
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
    confidence = sample_confidence(w.num_requests, MIN_REQUESTS)
    if peak > buffer:
        effect = "the buffer covers the observed peak with a quarter to spare: fewer OOMs"
    elif peak < buffer / 2 and w.num_ooms == 0 and target < buffer:
        effect = f"{(buffer - target) / MIB:.0f} MiB kept back for fragmentation become KV cache"
        confidence *= 0.8
    else:
        return None
    return propose(
        ctx, "fragmentationBuffer", f"{target // MIB}Mi", "fragmentation-buffer", evidence,
        effect, confidence,
    )  # fmt: skip
