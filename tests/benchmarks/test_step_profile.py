"""The pure parts of benchmarks/step_profile.py: step intervals by bin, kernels by name."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import FIRST_STEPS, StepStamp, bin_steps, kernel_table


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
    events = [("attn", 10.0), ("gemm", 2.0), ("attn", 12.0), ("gemm", 2.5), ("norm", 1.0)]
    table = kernel_table(events, num_steps=2)
    assert [row["kernel"] for row in table] == ["attn", "gemm", "norm"]
    assert table[0] == {"kernel": "attn", "launches": 1.0, "us": 11.0}
    assert table[2]["launches"] == 0.5
