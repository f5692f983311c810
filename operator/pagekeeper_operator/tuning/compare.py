"""Canary against baseline (pure): did the change measurably win?

The samples are output tokens/s per pod, `observe.SAMPLES_PER_WINDOW` of them over the same
window (each over its own stretch of it), canary pods against baseline pods. The rule
(docs/memory-policy.md, Tuning):

- at least MIN_SAMPLES samples on each side, else no verdict yet;
- improvement = (mean canary - mean baseline) / mean baseline;
- noise = twice the standard error of that difference, relative to the baseline mean (Welch's:
  sqrt(s_c^2 / n_c + s_b^2 / n_b) / mean_b);
- a one-sided Mann-Whitney U test (normal approximation with tie correction, no assumption of
  normal throughput) gives p for "canary samples tend to be larger";
- a win needs improvement > max(noise, MIN_GAIN) and p < ALPHA, and under a bounded objective
  the canary's p99 (TTFT or ITL) within its bound;
- under a bounded objective the baseline's p99 can break the bound, by more than P99_MARGIN,
  while the canary's holds it: then the canary wins whatever its throughput, since under the
  objective a pod past its bound scores nothing. Meeting the bound is the gain: an open-loop
  burst offers both sides the same tokens, and halving the prefill chunk for ITL costs some.
Everything else, ties included, is not a win and is rolled back: keeping a change needs
evidence, dropping one does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, variance

ALPHA = 0.05
MIN_GAIN = 0.03
MIN_SAMPLES = 8
# How far past its bound the baseline's p99 must be for a canary within it to win on the bound:
# a p99 is one estimate from a histogram, so a baseline just over the bound is no evidence.
P99_MARGIN = 0.1


@dataclass(frozen=True)
class Comparison:
    """The numbers a trial is decided on, and the verdict."""

    canary_mean: float
    baseline_mean: float
    improvement: float
    noise: float
    p_value: float
    num_canary: int
    num_baseline: int
    is_win: bool
    reason: str
    canary_p99: float | None = None  # seconds, under a bounded objective
    baseline_p99: float | None = None

    def evidence(self) -> dict[str, float]:
        numbers = {
            "canaryTokensPerSecond": round(self.canary_mean, 3),
            "baselineTokensPerSecond": round(self.baseline_mean, 3),
            "improvement": round(self.improvement, 4),
            "noise": round(self.noise, 4),
            "pValue": round(self.p_value, 4),
            "canarySamples": float(self.num_canary),
            "baselineSamples": float(self.num_baseline),
        }
        p99s = {"canaryP99Seconds": self.canary_p99, "baselineP99Seconds": self.baseline_p99}
        return numbers | {k: round(v, 4) for k, v in p99s.items() if v is not None}


def mann_whitney_greater(xs: Sequence[float], ys: Sequence[float]) -> float:
    """One-sided p-value that values of `xs` tend to exceed those of `ys` (normal
    approximation with continuity and tie corrections)."""
    n_x, n_y = len(xs), len(ys)
    pooled = sorted([(v, 0) for v in xs] + [(v, 1) for v in ys])
    ranks = [0.0] * len(pooled)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1  # the average rank of a tie group
        size = j - i + 1
        tie_term += size**3 - size
        i = j + 1
    rank_sum_x = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 0)
    u = rank_sum_x - n_x * (n_x + 1) / 2
    n = n_x + n_y
    var = n_x * n_y / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:
        return 0.5  # every value equal: no evidence either way
    z = (u - n_x * n_y / 2 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def compare(
    canary: Sequence[float],
    baseline: Sequence[float],
    *,
    canary_p99: float | None = None,
    p99_bound: float | None = None,
    baseline_p99: float | None = None,
) -> Comparison | None:
    """The verdict on the samples; None while either side has fewer than MIN_SAMPLES."""
    if len(canary) < MIN_SAMPLES or len(baseline) < MIN_SAMPLES:
        return None
    mean_c, mean_b = fmean(canary), fmean(baseline)
    if mean_b <= 0:
        improvement = math.inf if mean_c > 0 else 0.0
        noise = 0.0
    else:
        improvement = (mean_c - mean_b) / mean_b
        error = math.sqrt(variance(canary) / len(canary) + variance(baseline) / len(baseline))
        noise = 2 * error / mean_b
    p_value = mann_whitney_greater(canary, baseline)
    needed = max(noise, MIN_GAIN)
    if p99_bound is not None and (canary_p99 is None or canary_p99 > p99_bound):
        shown = "no p99" if canary_p99 is None else f"p99 {canary_p99:.3g}s"
        is_win, reason = False, f"the canary's {shown} is not within the {p99_bound:g}s bound"
    elif (
        p99_bound is not None
        and baseline_p99 is not None
        and baseline_p99 > p99_bound * (1 + P99_MARGIN)
    ):
        is_win = True
        reason = (
            f"the canary's p99 {canary_p99:.3g}s meets the {p99_bound:g}s bound that the "
            f"baseline's {baseline_p99:.3g}s breaks ({improvement:+.1%} tokens/s, noise "
            f"{noise:.1%})"
        )
    elif improvement <= needed:
        is_win = False
        reason = f"improvement {improvement:+.1%} is not above max(noise {noise:.1%}, 3%)"
    elif p_value >= ALPHA:
        is_win, reason = False, f"p = {p_value:.3f} is not below {ALPHA}"
    else:
        is_win = True
        reason = f"{improvement:+.1%} tokens/s (noise {noise:.1%}, p = {p_value:.3f})"
    return Comparison(
        mean_c, mean_b, improvement, noise, p_value, len(canary), len(baseline), is_win, reason,
        canary_p99 if p99_bound is not None else None,
        baseline_p99 if p99_bound is not None else None,
    )  # fmt: skip
