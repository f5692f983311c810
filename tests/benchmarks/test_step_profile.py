"""The pure parts of benchmarks/step_profile.py: step intervals by bin, kernels by name."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import (
    FIRST_STEPS,
    DeviceSpan,
    StepStamp,
    bin_steps,
    device_spans,
    kernel_table,
    span_us,
)


def test_intervals_go_to_the_first_steps_then_to_the_running_requests_bin() -> None:
    started = 100.0
    # FIRST_STEPS prefill steps of 0.03 s, then steps of 256, 150, 64, 16, 2 and 1 requests.
    stamps = [StepStamp(started + 0.03 * (i + 1), 256) for i in range(FIRST_STEPS)]
    t = stamps[-1].ended_s
    for running, interval in (
        (256, 0.006),
        (150, 0.007),
        (64, 0.003),
        (16, 0.002),
        (2, 0.0015),
        (1, 0.001),
    ):
        t += interval
        stamps.append(StepStamp(t, running))
    bins = {b.label: b for b in bin_steps(started, stamps)}
    assert list(bins) == ["first steps", "193-256", "129-192", "17-64", "2-16", "1"]
    assert bins["first steps"].steps == FIRST_STEPS
    assert bins["first steps"].seconds == pytest.approx(0.03 * FIRST_STEPS)
    assert bins["17-64"].seconds == pytest.approx(0.003)
    assert bins["2-16"].steps == 2 and bins["2-16"].seconds == pytest.approx(0.0035)
    assert bins["1"].ms_per_step == pytest.approx(1.0)
    assert sum(b.seconds for b in bins.values()) == pytest.approx(t - started)


def test_a_step_with_nothing_running_is_idle() -> None:
    stamps = [StepStamp(float(i + 1), 4) for i in range(FIRST_STEPS)] + [StepStamp(20.0, 0)]
    assert bin_steps(0.0, stamps)[-1].label == "idle"


def test_kernels_are_summed_by_name_per_step() -> None:
    spans = [
        DeviceSpan("attn", 0.0, 10.0),
        DeviceSpan("gemm", 10.0, 2.0),
        DeviceSpan("attn", 20.0, 12.0),
        DeviceSpan("gemm", 32.0, 2.5),
        DeviceSpan("norm", 40.0, 1.0),
    ]
    table = kernel_table(spans, num_steps=2)
    assert [row["kernel"] for row in table] == ["attn", "gemm", "norm"]
    assert table[0] == {
        "kernel": "attn",
        "launches": 1.0,
        "us": 11.0,
        "effective_us": 11.0,
        "min_us": 10.0,
        "median_us": 11.0,
    }
    assert table[2]["launches"] == 0.5


def test_a_collectives_shortest_launch_stands_apart_from_its_median() -> None:
    """A launch that waited for its peers is long; the shortest shows the kernel's own cost."""
    spans = [DeviceSpan("reduce", 10.0 * i, us) for i, us in enumerate((3.0, 9.0, 8.0, 30.0))]
    (row,) = kernel_table(spans, num_steps=4)
    assert (row["min_us"], row["median_us"], row["us"]) == (3.0, 8.5, 12.5)


def test_an_early_launched_kernel_counts_only_what_it_adds() -> None:
    """Under dependent launch the o projection starts inside attention's span and waits there:
    its effective time is what it adds after attention ends, and the column sums to the busy
    time, not to the sum of durations."""
    spans = [
        DeviceSpan("qkv", 0.0, 5.0),
        DeviceSpan("attn", 4.0, 10.0),  # launched early, ends at 14
        DeviceSpan("o_proj", 5.0, 12.0),  # launched early, ends at 17: adds 3
        DeviceSpan("head", 20.0, 5.0),  # after a 3-us gap
    ]
    table = {row["kernel"]: row for row in kernel_table(spans, num_steps=1)}
    assert table["attn"]["effective_us"] == pytest.approx(9.0)
    assert table["o_proj"]["effective_us"] == pytest.approx(3.0)
    assert table["o_proj"]["us"] == pytest.approx(12.0)
    assert sum(row["effective_us"] for row in table.values()) == pytest.approx(22.0)
    assert span_us(spans) == pytest.approx(25.0)


def test_device_spans_come_from_the_traces_device_events_in_order() -> None:
    trace = {
        "traceEvents": [
            {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 9.0},
            {"cat": "kernel", "name": "gemv", "ts": 30.0, "dur": 2.0},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 10.0, "dur": 1.0},
            {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5.0, "dur": 3.0},
            {"cat": "gpu_memset", "name": "Memset", "ts": 20.0},
        ]
    }
    assert device_spans(trace) == [
        DeviceSpan("Memcpy HtoD", 10.0, 1.0),
        DeviceSpan("Memset", 20.0, 0.0),
        DeviceSpan("gemv", 30.0, 2.0),
    ]
    assert span_us([]) == 0.0
