"""Histograms read from two /metrics pages (pure): what was observed between them, and its
quantiles as Prometheus's `histogram_quantile` estimates them from the buckets.

`structured.py` reads the engine's `pagekeeper_grammar_*_seconds` this way around its schema
pass: the count, the sum and the approximate p50/p90/p99 of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUANTILES = (0.5, 0.9, 0.99)
IGNORED_LABELS = frozenset({"model_name", "le"})


@dataclass(frozen=True)
class Histogram:
    """One series of a histogram: its buckets' upper bounds (ascending, the last +Inf) with
    their cumulative counts, and the sum of what was observed."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """What was observed since `earlier` (the same series, read before)."""
        if earlier is None:
            return self
        assert earlier.bounds == self.bounds, "the buckets changed between the readings"
        cumulative = tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True))
        return Histogram(self.bounds, cumulative, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """`histogram_quantile(q)`: linear within the bucket that holds the rank; the largest
        finite bound where the rank is above it; None with nothing observed."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


def read_histograms(text: str, prefix: str) -> dict[str, Histogram]:
    """The histograms of a /metrics page whose names start with `prefix`, by series: the name
    without `prefix` and `_seconds`, then `[value]` for each label other than `model_name`."""
    found: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not family.name.startswith(prefix):
            continue
        base = family.name.removeprefix(prefix).removesuffix("_seconds")
        buckets: dict[str, list[tuple[float, float]]] = {}
        sums: dict[str, float] = {}
        for sample in family.samples:
            extra = sorted((k, v) for k, v in sample.labels.items() if k not in IGNORED_LABELS)
            key = base + "".join(f"[{v}]" for _, v in extra)
            if sample.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[key] = sample.value
        for key, pairs in buckets.items():
            pairs.sort()
            bounds, cumulative = zip(*pairs, strict=True)
            found[key] = Histogram(tuple(bounds), tuple(cumulative), sums.get(key, 0.0))
    return found


def summarize(before: str, after: str, prefix: str) -> dict[str, dict[str, Any]]:
    """Per series of `prefix`, what was observed between the two pages: count, sum (seconds)
    and the estimated quantiles (seconds, None with nothing observed)."""
    earlier = read_histograms(before, prefix)
    report: dict[str, dict[str, Any]] = {}
    for key, histogram in sorted(read_histograms(after, prefix).items()):
        observed = histogram.minus(earlier.get(key))
        figures: dict[str, Any] = {"count": int(observed.count), "sum_s": observed.sum}
        for q in QUANTILES:
            figures[f"p{round(q * 100)}_s"] = observed.quantile(q)
        report[key] = figures
    return report


def format_table(report: dict[str, dict[str, Any]]) -> str:
    """One line a series: its count, mean and quantiles in milliseconds."""

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.3f}"

    lines = [f"{'series':<22} {'count':>7} {'mean ms':>8} {'p50':>8} {'p90':>8} {'p99':>8}"]
    for key, f in report.items():
        mean = f["sum_s"] / f["count"] if f["count"] else None
        lines.append(
            f"{key:<22} {f['count']:>7} {ms(mean):>8} {ms(f['p50_s']):>8} "
            f"{ms(f['p90_s']):>8} {ms(f['p99_s']):>8}"
        )
    return "\n".join(lines)
