"""A trial's samples from Prometheus: per pod, one sample per stretch of the trial's window, of
output tokens/s and of each secondary figure the objective names (`compare`).

The stretch is the trial window's sixteenth (`observe.sample_step`); an extended trial reads
its whole run at the same stretch, so each look adds samples rather than lengthening them. A
stretch with nothing to measure gives no sample: preemptions per 1,000 requests where no request
finished, a p99 where no request was seen (Prometheus answers NaN; a filter drops it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagekeeper_operator.api.tuning import SecondaryFigure
from pagekeeper_operator.tuning.compare import Samples
from pagekeeper_operator.tuning.observe import Scope

# (promql, label) -> label value -> samples; `prometheus.query_samples` at a URL
SampleQuery = Callable[[str, str], dict[str, list[float]]]
HISTOGRAMS: dict[SecondaryFigure, str] = {
    "TTFTP99": "vllm:time_to_first_token_seconds",
    "ITLP99": "vllm:inter_token_latency_seconds",
}


def per_stretch(expr: str, seconds: int, step: int) -> str:
    return f"({expr})[{seconds}s:{step}s]"


def throughput_samples_query(scope: Scope, seconds: int, step: int) -> str:
    rate = f"rate(vllm:generation_tokens_total{scope.selector}[{step}s])"
    return per_stretch(f"sum by (pod) ({rate})", seconds, step)


def figure_query(figure: SecondaryFigure, scope: Scope, seconds: int, step: int) -> str:
    """Per pod, the figure over each stretch (see the module docstring)."""
    sel = scope.selector
    if figure == "PreemptionsPer1000Requests":
        preempted = f"sum by (pod) (increase(vllm:num_preemptions_total{sel}[{step}s]))"
        finished = f"sum by (pod) (increase(vllm:request_success_total{sel}[{step}s]))"
        return per_stretch(f"1000 * {preempted} / ({finished} > 0)", seconds, step)
    rate = f"rate({HISTOGRAMS[figure]}_bucket{sel}[{step}s])"
    return per_stretch(f"histogram_quantile(0.99, sum by (pod, le) ({rate})) >= 0", seconds, step)


def pooled(by_pod: Mapping[str, list[float]]) -> list[float]:
    return [v for samples in by_pod.values() for v in samples]


def secondary_samples(
    query: SampleQuery,
    figures: tuple[SecondaryFigure, ...],
    canary: Scope,
    baseline: Scope,
    seconds: int,
    step: int,
) -> dict[SecondaryFigure, Samples]:
    """Each named figure's samples, the canary pods' pooled against the baseline pods'."""
    return {
        figure: Samples(
            pooled(query(figure_query(figure, canary, seconds, step), "pod")),
            pooled(query(figure_query(figure, baseline, seconds, step), "pod")),
        )
        for figure in figures
    }
