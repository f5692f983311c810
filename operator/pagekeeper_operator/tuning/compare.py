"""Canary against baseline (pure): did the change win, lose, tie, or can this window not tell?

The samples are per pod, one per stretch of the trial's window (`trial_queries`), canary pods
against baseline pods: output tokens/s (the primary figure) and the secondary figures the
objective names (`TuningSpec.secondaries`): preemptions per 1,000 requests, TTFT p99 and ITL
p99 of each stretch (lower is better). The rule (docs/memory-policy.md, Tuning), every test one
sided and rank based (`stats`), each at its share of ALPHA:

- **win on throughput**: the canary's tokens/s higher than the baseline's by more than MIN_GAIN;
- **win on a secondary figure**: tokens/s not lower by more than NON_INFERIORITY_MARGIN, and a
  named figure lower by more than SECONDARY_MIN_GAIN;
- **loss**: tokens/s lower by more than MIN_GAIN, or a named figure higher by more than
  SECONDARY_MIN_GAIN (the canary not a win);
- **tie**: none of those, and no gain still in sight: the observed tokens/s gain is under
  MIN_GAIN and no named figure is observed lower by SECONDARY_MIN_GAIN with tokens/s within
  the margin. Then more samples would not make a win (each test's statistic points away);
- **inconclusive**: an observed gain as large as the rule asks that is not yet significant
  (too few samples, too noisy): `decide` extends the trial.

The spread of the samples (`noise`, twice the standard error of the difference of the means) is
reported as evidence, never a threshold: the tests already weigh it, and asking the gain to
clear it as well counts the noise twice, so a noisy workload could never win.

The trial's false-win rate is at most ALPHA: each of the MAX_LOOKS looks gets ALPHA / MAX_LOOKS,
split between the two ways to win (Bonferroni), the secondary way's share again among its
figures; its non-inferiority test and its figure's test must both pass (an intersection-union
test keeps their level). Under a bounded objective the canary's p99 over the window must hold
the bound, and a canary that holds a bound the baseline breaks by more than P99_MARGIN wins
whatever its throughput: under the objective a pod past its bound scores nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean, variance
from typing import Literal

from pagekeeper_operator.api.tuning import MAX_LOOKS, SecondaryFigure
from pagekeeper_operator.tuning.stats import median, p_higher, p_lower

Verdict = Literal["Win", "Loss", "Tie", "Inconclusive"]
ALPHA = 0.05  # a trial's false-win rate, over all its looks
LOOK_ALPHA = ALPHA / MAX_LOOKS
MIN_GAIN = 0.03  # the smallest throughput gain worth a change
NON_INFERIORITY_MARGIN = 0.05  # the throughput a secondary figure's gain may cost
SECONDARY_MIN_GAIN = 0.2  # a fifth off a tail or off the preemptions is worth that margin
MIN_SAMPLES = 8
# How far past its bound the baseline's p99 must be for a canary within it to win on the bound:
# a p99 is one estimate from a histogram, so a baseline just over the bound is no evidence.
P99_MARGIN = 0.1
# figure -> (its words, its evidence name, how a side's samples are summed up)
FIGURES: dict[SecondaryFigure, tuple[str, str, str]] = {
    "PreemptionsPer1000Requests": ("preemptions/1k requests", "PreemptionsPer1k", "mean"),
    "TTFTP99": ("TTFT p99", "TtftP99Seconds", "median"),
    "ITLP99": ("ITL p99", "ItlP99Seconds", "median"),
}


@dataclass(frozen=True)
class Samples:
    """One figure's samples, a side each."""

    canary: Sequence[float]
    baseline: Sequence[float]


@dataclass(frozen=True)
class FigureResult:
    """A secondary figure's summaries (mean of a rate, median of a p99) and its tests."""

    figure: SecondaryFigure
    canary: float
    baseline: float
    p_better: float  # lower on the canary by more than SECONDARY_MIN_GAIN
    p_worse: float  # higher on the canary by more than SECONDARY_MIN_GAIN

    @property
    def change(self) -> float:
        if self.baseline > 0:
            return (self.canary - self.baseline) / self.baseline
        return 0.0 if self.canary <= 0 else math.inf

    def text(self, p: float) -> str:
        return f"{FIGURES[self.figure][0]} {self.change:+.0%} (p = {p:.3g})"


@dataclass(frozen=True)
class Comparison:
    """The numbers a trial is decided on, and the verdict."""

    canary_mean: float
    baseline_mean: float
    improvement: float
    noise: float
    p_value: float  # tokens/s higher by more than MIN_GAIN
    num_canary: int
    num_baseline: int
    verdict: Verdict
    reason: str
    canary_p99: float | None = None  # seconds, under a bounded objective
    baseline_p99: float | None = None
    figures: tuple[FigureResult, ...] = ()

    @property
    def is_win(self) -> bool:
        return self.verdict == "Win"

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
        for f in self.figures:
            name = FIGURES[f.figure][1]
            p99s |= {f"canary{name}": f.canary, f"baseline{name}": f.baseline}
        return numbers | {k: round(v, 4) for k, v in p99s.items() if v is not None}


def _summary(figure: SecondaryFigure, values: Sequence[float]) -> float:
    return fmean(values) if FIGURES[figure][2] == "mean" else median(values)


def _figures(secondary: Mapping[SecondaryFigure, Samples]) -> tuple[FigureResult, ...]:
    """Each figure with enough samples a side, tested (a figure without is left out)."""
    return tuple(
        FigureResult(
            figure,
            _summary(figure, s.canary),
            _summary(figure, s.baseline),
            p_lower(s.canary, s.baseline, SECONDARY_MIN_GAIN),
            p_higher(s.canary, s.baseline, SECONDARY_MIN_GAIN),
        )
        for figure, s in secondary.items()
        if min(len(s.canary), len(s.baseline)) >= MIN_SAMPLES
    )


def _verdict(
    canary: Sequence[float],
    baseline: Sequence[float],
    improvement: float,
    p_gain: float,
    figures: tuple[FigureResult, ...],
    num_named: int,
) -> tuple[Verdict, str]:
    """The verdict on throughput and the secondary figures (see the module docstring)."""
    primary_alpha = LOOK_ALPHA / 2 if num_named else LOOK_ALPHA
    figure_alpha = LOOK_ALPHA / 2 / max(1, num_named)
    gain = f"{improvement:+.1%} tokens/s"
    if p_gain < primary_alpha:
        return "Win", f"{gain}, more than +{MIN_GAIN:.0%} (p = {p_gain:.3g})"
    p_within = p_higher(canary, baseline, -NON_INFERIORITY_MARGIN)
    within = f"{gain}, not below -{NON_INFERIORITY_MARGIN:.0%} (p = {p_within:.3g})"
    better = sorted((f for f in figures if f.p_better < figure_alpha), key=lambda f: f.p_better)
    if better and p_within < LOOK_ALPHA / 2:
        return "Win", f"{better[0].text(better[0].p_better)} with {within}"
    p_loss = p_lower(canary, baseline, MIN_GAIN)
    if p_loss < primary_alpha:
        return "Loss", f"{gain}, less than -{MIN_GAIN:.0%} (p = {p_loss:.3g})"
    worse = sorted((f for f in figures if f.p_worse < figure_alpha), key=lambda f: f.p_worse)
    if worse:
        return "Loss", f"{worse[0].text(worse[0].p_worse)} with {gain}"
    if improvement >= MIN_GAIN:
        return "Inconclusive", (
            f"{gain} is not yet significant (p = {p_gain:.3g} against {primary_alpha:.3g})"
        )
    hoped = [f for f in figures if -f.change >= SECONDARY_MIN_GAIN]
    if hoped and improvement >= -NON_INFERIORITY_MARGIN:
        waiting = " and ".join(
            f.text(f.p_better) for f in hoped if f.p_better >= figure_alpha
        ) or within  # fmt: skip
        return "Inconclusive", f"{waiting} is not yet significant"
    others = ", and no secondary figure a fifth lower" if figures else ""
    return "Tie", f"{gain}, under +{MIN_GAIN:.0%}{others}"


def compare(
    canary: Sequence[float],
    baseline: Sequence[float],
    *,
    secondary: Mapping[SecondaryFigure, Samples] | None = None,
    canary_p99: float | None = None,
    p99_bound: float | None = None,
    baseline_p99: float | None = None,
) -> Comparison | None:
    """The verdict on the samples; None while either side has fewer than MIN_SAMPLES tokens/s
    samples. `secondary`: the figures the objective names (each judged only with MIN_SAMPLES
    a side); `p99_bound`: the bounded objective's, with both sides' p99 over the window."""
    if len(canary) < MIN_SAMPLES or len(baseline) < MIN_SAMPLES:
        return None
    secondary = secondary or {}
    mean_c, mean_b = fmean(canary), fmean(baseline)
    if mean_b <= 0:
        improvement = math.inf if mean_c > 0 else 0.0
        noise = 0.0
    else:
        improvement = (mean_c - mean_b) / mean_b
        error = math.sqrt(variance(canary) / len(canary) + variance(baseline) / len(baseline))
        noise = 2 * error / mean_b
    p_gain = p_higher(canary, baseline, MIN_GAIN)
    figures = _figures(secondary)
    verdict: Verdict
    if p99_bound is not None and (canary_p99 is None or canary_p99 > p99_bound):
        shown = "no p99" if canary_p99 is None else f"p99 {canary_p99:.3g}s"
        verdict, reason = "Loss", f"the canary's {shown} is not within the {p99_bound:g}s bound"
    elif (
        p99_bound is not None
        and baseline_p99 is not None
        and baseline_p99 > p99_bound * (1 + P99_MARGIN)
    ):
        verdict = "Win"
        reason = (
            f"the canary's p99 {canary_p99:.3g}s meets the {p99_bound:g}s bound that the "
            f"baseline's {baseline_p99:.3g}s breaks ({improvement:+.1%} tokens/s)"
        )
    else:
        verdict, reason = _verdict(canary, baseline, improvement, p_gain, figures, len(secondary))
    return Comparison(
        mean_c, mean_b, improvement, noise, p_gain, len(canary), len(baseline), verdict,
        f"{reason}; noise {noise:.1%}",
        canary_p99 if p99_bound is not None else None,
        baseline_p99 if p99_bound is not None else None,
        figures,
    )  # fmt: skip
