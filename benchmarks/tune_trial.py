"""W-tune's rounds as Apply mode runs them (pure): after the first round, each round is a trial
of the top recommendation against the policy in force, judged by the operator's own rule
(`pagekeeper_operator.tuning.compare`) and kept only when it wins; whatever the verdict, the
field is then held for the rest of the run (Apply mode's hold-off, a day by default, is longer
than a run).

In a cluster the canary and the baseline pods serve the same window side by side. Here they are
two rounds of the same seeded requests one after the other, so each side's throughput samples
come from its own round: output tokens/s over SAMPLES equal stretches of the span in which the
load is the same for both (a closed loop's clients are all busy until the last request is sent;
an open loop's arrivals are the same list), read from the engine's own counter.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from benchmarks.serving_workload import RequestRecord
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.tuning.compare import Comparison, compare
from pagekeeper_operator.tuning.observe import SAMPLES_PER_WINDOW

SAMPLES = SAMPLES_PER_WINDOW  # per side, as the operator reads a trial's window


@dataclass(frozen=True)
class Reading:
    """One reading of `vllm:generation_tokens_total` at `at_s` (time.monotonic seconds)."""

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


def throughput_samples(
    readings: Sequence[Reading], start_s: float, end_s: float, num: int = SAMPLES
) -> list[float]:
    """Output tokens/s over `num` equal stretches of [start_s, end_s]."""
    assert end_s > start_s, f"an empty span [{start_s}, {end_s}]"
    step = (end_s - start_s) / num
    edges = [counter_at(readings, start_s + k * step) for k in range(num + 1)]
    return [(b - a) / step for a, b in pairwise(edges)]


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
    """What the trial rule reads of one round: its throughput samples and its p99s (s)."""

    samples: list[float]
    ttft_p99_s: float | None
    itl_p99_s: float | None

    def p99(self, spec: TuningSpec) -> float | None:
        if spec.objective == "ThroughputUnderTTFT":
            return self.ttft_p99_s
        if spec.objective == "ThroughputUnderITL":
            return self.itl_p99_s
        return None


def judge(trial: RoundFigures, baseline: RoundFigures, spec: TuningSpec) -> Comparison | None:
    """The operator's verdict on a trial round against the round of the policy in force."""
    return compare(
        trial.samples, baseline.samples,
        canary_p99=trial.p99(spec), p99_bound=bound_of(spec), baseline_p99=baseline.p99(spec),
    )  # fmt: skip
