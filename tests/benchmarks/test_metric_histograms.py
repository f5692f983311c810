"""Histograms between two /metrics pages: the observations in between by series, and the
quantiles Prometheus's `histogram_quantile` gives for them."""

from __future__ import annotations

import pytest

from benchmarks.metric_histograms import Histogram, format_table, read_histograms, summarize

INF = float("inf")


def page(fill: tuple[int, int, int], fill_sum: float, bitmask: tuple[int, int, int]) -> str:
    """A page with a plain histogram and one labelled series of another (bounds 1 ms, 2 ms)."""
    lines = []
    for name, extra, counts, total in (
        ("pagekeeper_grammar_fill_seconds", "", fill, fill_sum),
        ("pagekeeper_grammar_fill_part_seconds", ',part="bitmask"', bitmask, 0.5),
    ):
        lines.append(f"# TYPE {name} histogram")
        for le, count in zip(("0.001", "0.002", "+Inf"), counts, strict=True):
            lines.append(f'{name}_bucket{{model_name="m"{extra},le="{le}"}} {count}')
        lines.append(f'{name}_count{{model_name="m"{extra}}} {counts[-1]}')
        lines.append(f'{name}_sum{{model_name="m"{extra}}} {total}')
    lines.append("# TYPE vllm:num_requests_running gauge")
    lines.append('vllm:num_requests_running{model_name="m"} 3')
    return "\n".join(lines) + "\n"


def test_series_are_keyed_by_name_and_label_values() -> None:
    found = read_histograms(page((1, 3, 4), 0.25, (2, 2, 2)), "pagekeeper_grammar_")
    assert found == {
        "fill": Histogram((0.001, 0.002, INF), (1.0, 3.0, 4.0), 0.25),
        "fill_part[bitmask]": Histogram((0.001, 0.002, INF), (2.0, 2.0, 2.0), 0.5),
    }


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    histogram = Histogram((0.001, 0.002, INF), (2.0, 6.0, 8.0), 0.1)
    assert histogram.quantile(0.25) == pytest.approx(0.001)  # rank 2: the first bucket's top
    assert histogram.quantile(0.5) == pytest.approx(0.0015)  # rank 4: half-way through 1-2 ms
    assert histogram.quantile(0.125) == pytest.approx(0.0005)
    assert histogram.quantile(0.9) == 0.002, "above the last finite bound: that bound"
    assert Histogram((0.001, INF), (0.0, 0.0), 0.0).quantile(0.5) is None


def test_only_what_was_observed_between_the_pages_is_reported() -> None:
    before = page((1, 3, 4), 0.25, (2, 2, 2))
    after = page((1, 7, 8), 0.45, (2, 2, 2))
    report = summarize(before, after, "pagekeeper_grammar_")
    assert report["fill"] == {
        "count": 4, "sum_s": pytest.approx(0.2), "p50_s": pytest.approx(0.0015),
        "p90_s": pytest.approx(0.0019), "p99_s": pytest.approx(0.00199),
    }  # fmt: skip
    assert report["fill_part[bitmask]"] == {
        "count": 0,
        "sum_s": 0.0,
        "p50_s": None,
        "p90_s": None,
        "p99_s": None,
    }
    table = format_table(report).splitlines()
    assert table[1].split() == ["fill", "4", "50.000", "1.500", "1.900", "1.990"]
    assert table[2].split() == ["fill_part[bitmask]", "0", "-", "-", "-", "-"]
