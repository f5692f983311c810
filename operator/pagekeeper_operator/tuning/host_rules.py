"""The host KV tier's rules (pure): turn `kvOffload` on, grow it, or shrink it. `rules` runs them
beside the others; the conventions (evidence, confidence, clipping to bounds) are the same, and
docs/memory-policy.md, The host KV tier, explains them.

- kv-offload-down: the tier on, the engine container's memory limit set by the spec, and its
  working set at or above the host-memory alert's threshold of that limit at some point of the
  window (the alert's own figures, `alerts.host`; spec.remediation.triggers.hostMemory). The
  tier shrinks by the bytes that bring that peak to HOST_MARGIN under the threshold, in whole
  GiB, not below the bound's min (1Gi unset). Under a limit the memory plan sets, the limit is
  the plan's total with the tier in it: a smaller tier lowers the limit by as much and frees no
  headroom, so the rule is silent there (the runbook's OOMKilled section says what helps).
- kv-offload-on: prefix caching on, no tier, >= MIN_PREFIX_TOKENS looked up and at least
  EVICTED_MISS_SHARE of them evicted from the GPU cache and asked for again: a tier the size of
  the pod's GPU KV cache, in whole GiB up. The engine counts such misses against a record as
  large as both tiers together, so a tier that size would have held every one of them. Without
  the budget's series (no GPU) the bound's min, and with neither, nothing.
- kv-offload-up: the tier on and the same evidence (the engine counts a miss only once the tier
  too has evicted the block): twice the tier (KV_OFFLOAD_GROWTH), within the bound's max.

Neither grows the tier after an out-of-memory event or under a step-down (whose cap would keep
the larger tier from running), nor while the working set is near the limit. The memory plan
decides whether the candidate fits (`tuner`, PolicyFits's host terms): one that does not is
dropped like any other recommendation.
"""

from __future__ import annotations

import math

from pagekeeper_operator.tuning.proposal import (
    MIN_PREFIX_TOKENS,
    Context,
    Proposal,
    propose,
    sample_confidence,
)

GiB = 1 << 30
MiB = 1 << 20
# A tenth of looked-up prompt tokens recomputed because the cache had let them go: prefill a
# tier would load instead. The tier costs host memory, not throughput: with no reuse in the
# workload it served within 0.5% of no tier (docs/benchmarks.md, W-agent), so the bar is lower
# than prefix-caching-on's 30%, whose cost is the host's hashing on every prompt.
EVICTED_MISS_SHARE = 0.1
KV_OFFLOAD_GROWTH = 2
# The smallest tier the tuner sets with no bound (adaptive.minKvOffloadSize's default).
MIN_TIER_BYTES = GiB
# kv-offload-down aims this far under the alert's threshold, so the next window's growth of the
# working set does not bring it back at once.
HOST_MARGIN = 0.1


def size_text(num_bytes: int) -> str:
    """A size as the shortest exact quantity text: 24Gi, 1536Mi, or bytes."""
    for suffix, unit in (("Gi", GiB), ("Mi", MiB)):
        if num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)


def _limits(ctx: Context) -> tuple[int, int | None]:
    tier = ctx.tuning.bounds.kv_offload_size
    return (MIN_TIER_BYTES, None) if tier is None else (tier.min_bytes, tier.max_bytes)


def kv_offload(ctx: Context) -> Proposal | None:
    w, tier = ctx.window, ctx.policy.kv_offload
    shrink = _shrink(ctx, tier.size_bytes) if tier is not None else None
    if shrink is not None:
        return shrink
    share = w.evicted_miss_share
    if share is None or share < EVICTED_MISS_SHARE or w.prefix_queries < MIN_PREFIX_TOKENS:
        return None
    if not ctx.policy.enable_prefix_caching or w.num_ooms > 0 or w.is_stepped_down:
        return None
    if (w.host_memory_ratio_peak or 0.0) >= ctx.host_memory_threshold:
        return None  # near the limit: more pinned memory is the wrong way
    low, high = _limits(ctx)
    evidence = {"evictedMissShare": share, "prefixQueryTokens": w.prefix_queries}
    confidence = sample_confidence(w.prefix_queries, MIN_PREFIX_TOKENS) * min(
        1.0, share / (2 * EVICTED_MISS_SHARE)
    )
    if tier is None:
        if w.kv_cache_bytes is not None:
            new = math.ceil(w.kv_cache_bytes / GiB) * GiB
            evidence["gpuKvCacheGiB"] = w.kv_cache_bytes / GiB
        elif ctx.tuning.bounds.kv_offload_size is not None:
            new = low
        else:
            return None
        new = max(low, new) if high is None else min(high, max(low, new))
        return propose(
            ctx, "kvOffload.size", size_text(new), "kv-offload-on", evidence,
            f"{share:.0%} of looked-up prompt tokens had been evicted from the GPU cache and "
            "were computed again: a host tier keeps them, a later hit loads instead of "
            "recomputing (TTFT down)", confidence,
        )  # fmt: skip
    current = tier.size_bytes
    new = current * KV_OFFLOAD_GROWTH if high is None else min(high, current * KV_OFFLOAD_GROWTH)
    if new <= current:
        return None
    evidence["kvOffloadGiB"] = current / GiB
    return propose(
        ctx, "kvOffload.size", size_text(new), "kv-offload-up", evidence,
        f"{share:.0%} of looked-up prompt tokens had left both tiers and were computed again: "
        "a larger tier keeps more of them", confidence,
    )  # fmt: skip


def _shrink(ctx: Context, current: int) -> Proposal | None:
    w, threshold = ctx.window, ctx.host_memory_threshold
    peak, limit = w.host_memory_ratio_peak, w.memory_limit_bytes
    if not ctx.is_memory_limit_fixed or peak is None or limit is None or peak < threshold:
        return None
    excess = (peak - (threshold - HOST_MARGIN)) * limit
    low, _ = _limits(ctx)
    new = max(low, math.floor((current - excess) / GiB) * GiB)
    if new >= current:
        return None
    evidence = {"workingSetPeakRatio": peak, "memoryLimitGiB": limit / GiB,
                "threshold": threshold, "kvOffloadGiB": current / GiB}  # fmt: skip
    return propose(
        ctx, "kvOffload.size", size_text(new), "kv-offload-down", evidence,
        f"the engine container's working set reached {peak:.0%} of its memory limit: "
        f"{(current - new) / GiB:g} GiB less pinned host memory keeps it from an OOM kill",
        min(1.0, 0.5 + 0.5 * (peak - threshold) / (1.0 - threshold)),
    )  # fmt: skip
