"""The recommender (pure): a metric window, the effective policy, the bounds -> proposals.

Each rule reads a few numbers of the window and proposes one field's value, or nothing. A rule
proposes nothing when its evidence is thin (fewer than its minimum samples): "no change" is a
result, not a failure. Every proposal is clipped to `spec.tuning.bounds` and to what the runtime
honours, and dropped if that leaves the value unchanged or the policy invalid. One proposal per
field; the list is ordered by `PRIORITY` (safety before capacity), then confidence.

The rules (derived in docs/memory-policy.md, Tuning):
- prefix-caching-off: hit rate < 0.3 over >= MIN_PREFIX_TOKENS looked-up tokens. At most 30% of
  prompt tokens skip prefill, while every full block of every prompt is hashed and looked up;
  freed blocks are evicted on demand, so the host's hashing is all that turning it off saves.
  Never while spec.gateway.kvEvents is enabled: the events report the prefix cache's blocks, so
  with the cache off a KV-aware router sees none (`fields.fields_fixed_by`: the tuner holds the
  field, `effective.compose` drops such a change, the API server refuses that spec).
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
  (MAX_SEQS_GROWTH). Where that runs the whole demand with the KV peak under
  HEADROOM_KV_PEAK, the cap is twice the demand (what max-num-seqs-headroom would propose
  next; running sequences stay at the demand, so the KV peak does not grow with it).
- max-num-seqs-headroom: the load reaches the cap (running at it in >= 5% of the window) where
  max-num-seqs-up does not apply, KV peak < 0.45 and no preemption: double it (the KV peak, by
  the same extrapolation, stays under 0.9). A cap equal to the demand is met at every
  turnover; the measured cost is in SEQ_CAP_REACHED's comment.
- max-num-seqs-down: >= 5% of requests preempted with KV peak >= 0.95: the cap admits more than
  the KV holds. New cap: 85% of the mean running count, the concurrency the KV actually held.
- batched-tokens: under ThroughputUnderTTFT with TTFT p99 above its bound and requests waiting,
  double maxNumBatchedTokens (more prompt tokens per step); under ThroughputUnderITL with ITL
  p99 above its bound, halve it (shorter prefill chunks stall decodes less).
- the memory rules (utilization-up, kv-fp8, allocator-expandable, fragmentation-buffer):
  `memory_rules`; the host KV tier's (kv-offload-on, kv-offload-up, kv-offload-down):
  `host_rules`.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.policy.fields import is_tunable, with_change
from pagekeeper_operator.tuning.host_rules import kv_offload
from pagekeeper_operator.tuning.memory_rules import (
    allocator,
    fragmentation_buffer,
    kv_fp8,
    utilization,
)
from pagekeeper_operator.tuning.proposal import (
    DEFAULT_HOST_MEMORY_THRESHOLD,
    MIN_PREFIX_TOKENS,
    MIN_REQUESTS,
    Context,
    Proposal,
    Rule,
    clip_int,
    is_kv_bound,
    propose,
    sample_confidence,
)
from pagekeeper_operator.tuning.window import MetricWindow

PREFIX_HIT_THRESHOLD = 0.3
# The caching-off rule's gain is the host's hashing and lookups alone: on the H200 it stayed
# within the spread between engine starts (docs/benchmarks.md, W-tune), so it is offered at
# half the confidence its samples give.
OFF_GAIN_CONFIDENCE = 0.5
# How far one step may raise maxNumSeqs: KV use is extrapolated linearly from the window, so a
# bound keeps one wrong extrapolation from overshooting; 8x takes a cap of 16 to a demand of 128
# in one round.
MAX_SEQS_GROWTH = 8.0
SEQ_CAP_BINDS = 0.25  # share of the window at the cap for max-num-seqs-up
# max-num-seqs-headroom: a cap the load reaches (in this share of the window) with no request
# seen waiting still costs throughput on the H200: 128 streams at a cap of 128 served less
# than at 256 in all nine alternating pairs measured, +17% on average over the steady span
# (docs/benchmarks.md, W-tune). The cap doubles where the KV peak, doubled, stays under 90%;
# the gain was a measured win by the trial rule in five of nine pairs and a tie in
# the rest, so it is offered at half confidence and kept only where its trial wins.
SEQ_CAP_REACHED = 0.05
HEADROOM_GROWTH = 2
HEADROOM_KV_PEAK = 0.9 / HEADROOM_GROWTH  # KV use grows about linearly with running sequences
HEADROOM_CONFIDENCE = 0.5
PRIORITY = (
    # Host memory near its limit ends in an OOM kill of the whole pod.
    "kv-offload-down",
    "allocator-expandable",
    "fragmentation-buffer",
    # KV-bound with idle GPU memory: more KV removes the limit that fewer sequences and FP8 KV
    # only work around, at no cost in throughput or accuracy (W-tune's burst class).
    "utilization-up",
    "max-num-seqs-down",
    "kv-fp8",
    # A binding cap limits throughput by about demand / cap, more than any rule below saves a
    # token (W-tune's chat class: 16 -> 64 sequences gave 3.3x, caching off 1.2x).
    "max-num-seqs-up",
    "max-num-seqs-headroom",
    "prefix-caching-on",
    # Prefill of evicted prefixes loaded instead of recomputed, for host memory only.
    "kv-offload-on",
    "kv-offload-up",
    "prefix-caching-off",
    "block-size-down",
    "batched-tokens",
    "block-size-up",
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
        # Freed blocks stay evictable on demand, so the cache costs no capacity: what turning
        # it off saves is the host's hashing and lookups, small enough that a trial must show
        # it (OFF_GAIN_CONFIDENCE).
        return propose(
            ctx, "enablePrefixCaching", False, "prefix-caching-off", evidence,
            f"only {rate:.0%} of looked-up prompt tokens were cached: no hashing or lookup of "
            "prompt blocks on the host (a small saving; cached blocks cost no KV capacity)",
            sample_confidence(w.prefix_queries, MIN_PREFIX_TOKENS) * margin * OFF_GAIN_CONFIDENCE,
        )  # fmt: skip
    shadow = w.prefix_shadow_hits
    if shadow is None or w.prompt_tokens < MIN_PREFIX_TOKENS:
        return None
    share = shadow / w.prompt_tokens
    if share < PREFIX_HIT_THRESHOLD:
        return None
    evidence = {"repeatedPrefixShare": share, "promptTokens": w.prompt_tokens}
    return propose(
        ctx, "enablePrefixCaching", True, "prefix-caching-on", evidence,
        f"{share:.0%} of prompt tokens repeat an earlier prompt's blocks: that share of "
        "prefill is skipped, lowering TTFT",
        sample_confidence(w.prompt_tokens, MIN_PREFIX_TOKENS) * min(1.0, share / 0.6),
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
    confidence = sample_confidence(w.num_requests, MIN_REQUESTS)
    if waste >= 0.10 and is_kv_bound(w) and size // 2 in allowed:
        return propose(
            ctx, "blockSize", size // 2, "block-size-down", evidence,
            f"{waste:.0%} of allocated KV slots hold no token; half-size blocks waste about "
            f"{waste / 2:.0%}, so the same memory holds more sequences",
            confidence * min(1.0, waste / 0.2),
        )  # fmt: skip
    if waste < 0.02 and not is_kv_bound(w) and size * 2 in allowed:
        return propose(
            ctx, "blockSize", size * 2, "block-size-up", evidence,
            f"only {waste:.1%} of KV slots are wasted: larger blocks halve the block tables "
            f"at about {waste * 2:.1%} waste",
            confidence * 0.6,
        )  # fmt: skip
    return None


def max_num_seqs(ctx: Context) -> Proposal | None:
    w, policy, bounds = ctx.window, ctx.policy, ctx.tuning.bounds.max_num_seqs
    cap = policy.max_num_seqs
    low, high = (bounds.min, bounds.max) if bounds else (1, policy.max_num_batched_tokens)
    high = min(high, policy.max_num_batched_tokens)
    if w.num_requests < MIN_REQUESTS or w.kv_usage_peak is None:
        return None
    peak = w.kv_usage_peak
    if w.preemptions_per_request >= 0.05 and peak >= 0.95 and w.running_avg is not None:
        new = clip_int(int(min(cap, w.running_avg) * 0.85), low, high)
        evidence = {"preemptionsPerRequest": w.preemptions_per_request, "kvUsagePeak": peak,
                    "runningAvg": w.running_avg}  # fmt: skip
        return propose(
            ctx, "maxNumSeqs", new, "max-num-seqs-down", evidence,
            f"{w.preemptions_per_request:.0%} of requests were preempted: a cap the KV cache "
            "holds ends the recomputation",
            sample_confidence(w.num_requests, MIN_REQUESTS),
        )  # fmt: skip
    binds = w.seq_cap_fraction or 0.0
    if (
        binds >= SEQ_CAP_BINDS
        and (w.waiting_avg or 0.0) >= 1.0
        and peak < 0.8
        and w.num_preemptions == 0
    ):
        if w.running_peak is not None and w.waiting_peak is not None:
            demand, has_peaks = w.running_peak + w.waiting_peak, True
        else:  # a window without the peaks (an older runtime's series)
            demand, has_peaks = (w.running_avg or float(cap)) + (w.waiting_avg or 0.0), False
        running = int(min(cap * MAX_SEQS_GROWTH, cap * 0.9 / max(peak, 0.01), demand))
        # The whole demand (known from the peaks: a mean is no demand) fits, with KV room to
        # double it: the cap goes to twice the demand, as `max-num-seqs-headroom` would take
        # it next (running stays at the demand, so the KV peak is the demand's).
        roomy = has_peaks and running >= int(demand) and peak * running / cap < HEADROOM_KV_PEAK
        new = clip_int(running * HEADROOM_GROWTH if roomy else running, low, high)
        if new > cap:  # else the demand or the bounds leave no room above the cap
            evidence = {"seqCapFraction": binds, "kvUsagePeak": peak,
                        "waitingAvg": w.waiting_avg or 0.0, "demand": demand}  # fmt: skip
            room = ", with headroom above the demand" if roomy else ", KV peak near 90%"
            return propose(
                ctx, "maxNumSeqs", new, "max-num-seqs-up", evidence,
                f"the cap held requests waiting while KV peaked at {peak:.0%}: more run at "
                f"once{room}",
                sample_confidence(w.num_requests, MIN_REQUESTS) * binds,
            )  # fmt: skip
        return None
    if (
        binds >= SEQ_CAP_REACHED
        and (w.running_peak or 0.0) >= cap
        and peak < HEADROOM_KV_PEAK
        and w.num_preemptions == 0
    ):
        new = clip_int(cap * HEADROOM_GROWTH, low, high)
        if new <= cap:
            return None
        evidence = {"seqCapFraction": binds, "kvUsagePeak": peak,
                    "runningPeak": w.running_peak or 0.0}  # fmt: skip
        return propose(
            ctx, "maxNumSeqs", new, "max-num-seqs-headroom", evidence,
            f"the load reached the cap in {binds:.0%} of the window while KV peaked at "
            f"{peak:.0%}: headroom above it, KV peak under 90%",
            sample_confidence(w.num_requests, MIN_REQUESTS) * HEADROOM_CONFIDENCE,
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
    confidence = sample_confidence(w.num_requests, MIN_REQUESTS)
    ttft, itl = w.ttft_p99, w.itl_p99
    if tuning.objective == "ThroughputUnderTTFT" and ttft is not None and w.num_ooms == 0:
        limit = tuning.ttft_p99_seconds or math.inf
        if ttft > limit and (w.waiting_avg or 0.0) >= 1.0:
            evidence = {"ttftP99Seconds": ttft, "boundSeconds": limit}
            return propose(
                ctx, "maxNumBatchedTokens", clip_int(tokens * 2, low, high), "batched-tokens",
                evidence, "twice the prompt tokens per step: queued prompts start sooner (TTFT "
                "down), each step longer (ITL up)", confidence,
            )  # fmt: skip
    if tuning.objective == "ThroughputUnderITL" and itl is not None:
        limit = tuning.itl_p99_seconds or math.inf
        if itl > limit:
            evidence = {"itlP99Seconds": itl, "boundSeconds": limit}
            return propose(
                ctx, "maxNumBatchedTokens", clip_int(tokens // 2, low, high), "batched-tokens",
                evidence, "half the prompt tokens per step: a prefill chunk stalls the running "
                "decodes half as long (ITL down, TTFT up)", confidence,
            )  # fmt: skip
    return None


RULES: tuple[Rule, ...] = (
    allocator, fragmentation_buffer, max_num_seqs, kv_fp8, prefix_caching, block_size,
    batched_tokens, utilization, kv_offload,
)  # fmt: skip


def recommend(
    window: MetricWindow,
    policy: MemoryPolicy,
    tuning: TuningSpec,
    runtime: Runtime,
    held_fields: Collection[str] = (),
    *,
    host_memory_threshold: float = DEFAULT_HOST_MEMORY_THRESHOLD,
    is_memory_limit_fixed: bool = False,
) -> list[Proposal]:
    """Proposals for `policy` (the effective one) from `window`, best first; fields in
    `held_fields` (hold-offs, a trial under way, fields the spec fixes) are never proposed. The
    host terms: `proposal.Context`."""
    policy = policy.with_budget_resolved()
    ctx = Context(window, policy, tuning, runtime, host_memory_threshold, is_memory_limit_fixed)
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
