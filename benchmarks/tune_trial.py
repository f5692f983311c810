"""W-tune's rounds as Apply mode runs them (pure): after the first round, each round is a trial
of the top recommendation against the policy in force, judged by the operator's own rule
(`pagekeeper_operator.tuning.compare`) and kept only when it wins; whatever the verdict, the
field is then held for the rest of the run (Apply mode's hold-off, a day by default, is longer
than a run).

In a cluster the canary and the baseline pods serve the same window side by side. Here they are
two rounds of the same seeded requests one after the other, so each side's samples come from its
own round, one per each of SAMPLES equal stretches of the span in which the load is the same for
both (a closed loop's clients are all busy until the last request is sent; an open loop's
arrivals are the same list), as the operator reads a pod's (`tuning.trial_queries`): output
tokens/s and preemptions per 1,000 finished requests from the engine's own counters, and the
p99 of the TTFTs and of the inter-token gaps the clients saw end in the stretch. A stretch with
nothing to measure (no request finished, no first token) gives no sample of that figure.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from benchmarks.serving_report import percentile
from benchmarks.serving_workload import RequestRecord
from pagekeeper_operator.api.tuning import SecondaryFigure, TuningSpec
from pagekeeper_operator.tuning.compare import Comparison, Samples, compare
from pagekeeper_operator.tuning.observe import SAMPLES_PER_WINDOW

SAMPLES = SAMPLES_PER_WINDOW  # per side, as the operator reads a trial's window


@dataclass(frozen=True)
class Reading:
    """One reading of a counter (`vllm:generation_tokens_total`, ...) at `at_s`
    (time.monotonic seconds)."""

    at_s: float
    generated: float


def counter_at(readings: Sequence[Reading], at_s: float) -> float:
    """The counter at `at_s`, linear between the readings around it (clamped at the ends)."""
    assert readings, "no readings of the counter"
    times = [r.at_s for r in readings]
    i = bisect_left(times, at_s)
    if i == 0:
        return readings[0].generated
    if i == len(readings):
        return readings[-1].generated
    before, after = readings[i - 1], readings[i]
    share = (at_s - before.at_s) / (after.at_s - before.at_s)
    return before.generated + share * (after.generated - before.generated)


def stretch_edges(start_s: float, end_s: float, num: int = SAMPLES) -> list[float]:
    """The edges of `num` equal stretches of [start_s, end_s]."""
    assert end_s > start_s, f"an empty span [{start_s}, {end_s}]"
    step = (end_s - start_s) / num
    return [start_s + k * step for k in range(num + 1)]


def throughput_samples(
    readings: Sequence[Reading], start_s: float, end_s: float, num: int = SAMPLES
) -> list[float]:
    """Output tokens/s over `num` equal stretches of [start_s, end_s]."""
    edges = stretch_edges(start_s, end_s, num)
    values = [counter_at(readings, at_s) for at_s in edges]
    return [(b - a) / (edges[1] - edges[0]) for a, b in pairwise(values)]


def preemption_samples(
    preempted: Sequence[Reading], finished: Sequence[Reading], edges: Sequence[float]
) -> list[float]:
    """Preemptions per 1,000 finished requests in each stretch that finished one."""
    samples = []
    for a, b in pairwise(edges):
        done = counter_at(finished, b) - counter_at(finished, a)
        if done > 0:
            samples.append(1000 * (counter_at(preempted, b) - counter_at(preempted, a)) / done)
    return samples


def p99_samples(events: Sequence[tuple[float, float]], edges: Sequence[float]) -> list[float]:
    """The p99 of the values (`(at_s, value)` events) in each stretch that has one."""
    samples = []
    for a, b in pairwise(edges):
        values = [v for at_s, v in events if a <= at_s < b]
        if values:
            samples.append(percentile(values, 99))
    return samples


def secondary_samples(
    records: Sequence[RequestRecord],
    preempted: Sequence[Reading],
    finished: Sequence[Reading],
    edges: Sequence[float],
) -> dict[SecondaryFigure, list[float]]:
    """Each secondary figure's samples (the module docstring); preemptions only where the engine
    exported both counters."""
    ok = [r for r in records if r.failure is None]
    ttfts = [(r.send_s + ttft, ttft) for r in ok if (ttft := r.ttft_s) is not None]
    gaps = [gap for r in ok for gap in r.timed_inter_token_gaps()]
    figures: dict[SecondaryFigure, list[float]] = {
        "TTFTP99": p99_samples(ttfts, edges), "ITLP99": p99_samples(gaps, edges),
    }  # fmt: skip
    if preempted and finished:
        figures["PreemptionsPer1000Requests"] = preemption_samples(preempted, finished, edges)
    return figures


def steady_span(records: Sequence[RequestRecord], is_closed_loop: bool) -> tuple[float, float]:
    """Where both sides of a trial carry the same load: a closed loop's first send to its last
    (after it, clients finish one by one), an open loop's first send to its last end."""
    assert records, "a round without requests"
    start = min(r.send_s for r in records)
    end = max(r.send_s for r in records) if is_closed_loop else max(r.end_s for r in records)
    return start, end


def bound_of(spec: TuningSpec) -> float | None:
    """The objective's p99 bound in seconds (None: plain throughput)."""
    if spec.objective == "ThroughputUnderTTFT":
        return spec.ttft_p99_seconds
    if spec.objective == "ThroughputUnderITL":
        return spec.itl_p99_seconds
    return None


@dataclass(frozen=True)
class RoundFigures:
    """What the trial rule reads of one round: its throughput samples, its p99s over the round
    (s) and its secondary figures' samples (`secondary_samples`)."""

    samples: list[float]
    ttft_p99_s: float | None
    itl_p99_s: float | None
    secondary: dict[SecondaryFigure, list[float]] = field(default_factory=dict)

    def p99(self, spec: TuningSpec) -> float | None:
        if spec.objective == "ThroughputUnderTTFT":
            return self.ttft_p99_s
        if spec.objective == "ThroughputUnderITL":
            return self.itl_p99_s
        return None


def pooled(looks: Sequence[RoundFigures], p99: Callable[[Iterable[float]], float]) -> RoundFigures:
    """One side's looks at an extended trial as one: each figure's samples side by side, as the
    operator reads an extended trial's whole run at the same stretch (`tuning.trial_queries`);
    each p99 the `p99` of the looks' (`max` for the canary, which must hold a bound in every
    look; `min` for the baseline, which must break it in every look to lose on it)."""

    def each(values: Iterable[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return p99(known) if known else None

    figures = {f for look in looks for f in look.secondary}
    return RoundFigures(
        [x for look in looks for x in look.samples],
        each(look.ttft_p99_s for look in looks),
        each(look.itl_p99_s for look in looks),
        {f: [x for look in looks for x in look.secondary.get(f, [])] for f in sorted(figures)},
    )


def judge(trial: RoundFigures, baseline: RoundFigures, spec: TuningSpec) -> Comparison | None:
    """The operator's verdict on a trial round against the round of the policy in force, with
    the secondary figures the objective names (one a round did not measure has no samples, as
    in the operator's window)."""
    secondary = {
        figure: Samples(trial.secondary.get(figure, []), baseline.secondary.get(figure, []))
        for figure in spec.secondaries
    }
    return compare(
        trial.samples, baseline.samples, secondary=secondary,
        canary_p99=trial.p99(spec), p99_bound=bound_of(spec), baseline_p99=baseline.p99(spec),
    )  # fmt: skip
