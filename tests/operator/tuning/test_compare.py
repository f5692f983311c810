"""The canary-against-baseline rule: a win needs a gain above noise and 3%, and p < 0.05."""

from __future__ import annotations

import pytest

from pagekeeper_operator.tuning.compare import compare, mann_whitney_greater

BASELINE = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1002.0, 998.0, 1001.0, 999.0, 1003.0]


def shifted(factor: float) -> list[float]:
    return [v * factor for v in BASELINE]


def test_a_clear_gain_wins() -> None:
    result = compare(shifted(1.10), BASELINE)
    assert result is not None and result.is_win
    assert result.improvement == pytest.approx(0.10)
    assert result.p_value < 0.001
    assert result.evidence()["canarySamples"] == 10.0


def test_a_gain_under_three_percent_is_a_tie_and_not_kept() -> None:
    result = compare(shifted(1.02), BASELINE)
    assert result is not None and not result.is_win
    assert result.reason == "improvement +2.0% is not above max(noise 0.5%, 3%)"


def test_a_loss_is_not_kept() -> None:
    result = compare(shifted(0.9), BASELINE)
    assert result is not None and not result.is_win
    assert result.p_value > 0.99


def test_a_gain_within_the_noise_is_not_kept() -> None:
    noisy = [500.0, 1500.0] * 5
    result = compare([v * 1.05 for v in noisy], noisy)
    assert result is not None and not result.is_win
    assert result.noise > 0.05


def test_the_latency_bound_must_hold_on_the_canary() -> None:
    result = compare(shifted(1.10), BASELINE, canary_p99=2.5, p99_bound=2.0)
    assert result is not None and not result.is_win
    assert result.reason == "the canary's p99 2.5s is not within the 2s bound"
    within = compare(shifted(1.10), BASELINE, canary_p99=1.5, p99_bound=2.0)
    assert within is not None and within.is_win


def test_meeting_the_bound_the_baseline_breaks_is_the_gain() -> None:
    # An open-loop burst offers both sides the same tokens: throughput ties, TTFT does not.
    same = compare(shifted(1.0), BASELINE, canary_p99=1.2, p99_bound=2.0, baseline_p99=3.4)
    assert same is not None and same.is_win
    assert same.reason == (
        "the canary's p99 1.2s meets the 2s bound that the baseline's 3.4s breaks (+0.0% "
        "tokens/s, noise 0.5%)"
    )
    assert (same.evidence()["canaryP99Seconds"], same.evidence()["baselineP99Seconds"]) == (
        1.2,
        3.4,
    )
    # Under the objective a pod past its bound scores nothing: a slower canary within it wins.
    slower = compare(shifted(0.9), BASELINE, canary_p99=0.04, p99_bound=0.05, baseline_p99=0.07)
    assert slower is not None and slower.is_win and slower.improvement == pytest.approx(-0.1)
    # Just over the bound (within P99_MARGIN) is no evidence: the throughput rule decides.
    near = compare(shifted(1.0), BASELINE, canary_p99=1.9, p99_bound=2.0, baseline_p99=2.1)
    assert near is not None and not near.is_win
    assert near.reason == "improvement +0.0% is not above max(noise 0.5%, 3%)"
    # Both past the bound: the canary's own p99 refuses it first.
    both = compare(shifted(1.2), BASELINE, canary_p99=2.6, p99_bound=2.0, baseline_p99=3.4)
    assert both is not None and not both.is_win
    # Without a bound the p99s are not the objective and not evidence.
    plain = compare(shifted(1.0), BASELINE, canary_p99=1.2, baseline_p99=3.4)
    assert plain is not None and not plain.is_win and "canaryP99Seconds" not in plain.evidence()


def test_too_few_samples_give_no_verdict() -> None:
    assert compare(shifted(1.5)[:7], BASELINE) is None


def test_mann_whitney_of_identical_samples_is_even() -> None:
    assert mann_whitney_greater([5.0] * 8, [5.0] * 8) == 0.5
    # Fully separated groups of 8: the exact one-sided p is 1/12870; the approximation is close.
    assert mann_whitney_greater([2.0] * 4 + [3.0] * 4, [1.0] * 8) < 0.001
