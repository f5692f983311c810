"""Apply mode's decision: start within the daily cap, promote a win, roll back a loss or a tie,
extend a trial its window cannot decide and end it inconclusive at the bound, hold the field off
either way, never retry within the hold-off, and roll back at once a trial whose baseline moved
under it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pagekeeper_operator.api.tuning import Recommendation, TuningSpec, TuningStatus
from pagekeeper_operator.timestamps import format_time
from pagekeeper_operator.tuning.compare import compare
from pagekeeper_operator.tuning.decide import Baseline, TrialEvidence, decide, held_fields

T0 = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
SPEC = TuningSpec(mode="Apply", window_seconds=600, hold_off_seconds=3600, max_changes_per_day=2)
BASE = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1002.0, 998.0, 1001.0]
PREFIX_OFF = Recommendation(
    field="enablePrefixCaching", current="true", proposed="false", rule="prefix-caching-off",
    expected_effect="x", confidence=0.9, since="2026-11-29T00:00:00Z",
)  # fmt: skip
SPEC_VALUES = {"enablePrefixCaching": "true"}


def win() -> TrialEvidence:
    return TrialEvidence(compare([v * 1.1 for v in BASE], BASE))


def tie() -> TrialEvidence:
    return TrialEvidence(compare(BASE, BASE))


def started() -> TuningStatus:
    decision = decide(SPEC, TuningStatus(), [PREFIX_OFF], None, SPEC_VALUES, T0)
    assert decision.status.trial is not None
    return decision.status


def test_the_top_recommendation_starts_a_trial() -> None:
    decision = decide(SPEC, TuningStatus(), [PREFIX_OFF], None, SPEC_VALUES, T0)
    trial = decision.status.trial
    assert trial is not None
    assert (trial.field, trial.current, trial.proposed, format_time(trial.started_at)) == (
        "enablePrefixCaching", "true", "false", "2026-11-29T01:00:00Z",
    )  # fmt: skip
    assert (decision.status.day, decision.status.changes_today) == ("2026-11-29", 1)
    assert [e.reason for e in decision.events] == ["TuningTrialStarted"]
    assert held_fields(decision.status, T0) == {"enablePrefixCaching"}


def test_recommend_mode_and_the_daily_cap_start_nothing() -> None:
    recommend = SPEC.model_copy(update={"mode": "Recommend"})
    assert decide(recommend, TuningStatus(), [PREFIX_OFF], None, SPEC_VALUES, T0).events == []
    capped = TuningStatus(day="2026-11-29", changes_today=2)
    assert decide(SPEC, capped, [PREFIX_OFF], None, SPEC_VALUES, T0).status.trial is None
    # A new UTC day resets the count.
    next_day = decide(SPEC, capped, [PREFIX_OFF], None, SPEC_VALUES, T0 + timedelta(days=1))
    assert next_day.status.trial is not None and next_day.status.changes_today == 1


def test_a_trial_waits_for_its_window() -> None:
    status = started()
    decision = decide(SPEC, status, [], win(), SPEC_VALUES, T0 + timedelta(seconds=599))
    assert decision.status == status.model_copy(update={"hold_offs": []})
    assert decision.events == []


def test_a_win_is_promoted_into_the_tuning_layer_and_held() -> None:
    now = T0 + timedelta(seconds=600)
    decision = decide(SPEC, started(), [], win(), SPEC_VALUES, now)
    status = decision.status
    assert status.trial is None
    assert decision.promoted is not None
    assert [(c.field, c.value, c.spec_value, c.source) for c in status.changes] == [
        ("enablePrefixCaching", "false", "true", "Promoted")
    ]
    [record] = status.history
    assert record.outcome == "Promoted"
    numbers = {e.name: e.value for e in record.evidence}
    assert numbers["improvement"] == 0.1 and numbers["pValue"] < 0.001
    assert [(h.field, format_time(h.until)) for h in status.hold_offs] == [
        ("enablePrefixCaching", "2026-11-29T02:10:00Z")
    ]
    assert [e.reason for e in decision.events] == ["TuningPromoted"]


def test_a_tie_is_rolled_back_and_not_retried_within_the_hold_off() -> None:
    now = T0 + timedelta(seconds=600)
    decision = decide(SPEC, started(), [], tie(), SPEC_VALUES, now)
    status = decision.status
    assert (status.trial, status.changes) == (None, [])
    assert status.history[0].outcome == "RolledBack"
    assert status.history[0].message == (
        "enablePrefixCaching true -> false rolled back (tie): +0.0% tokens/s, under +3%; noise 0.6%"
    )
    assert [e.type for e in decision.events] == ["Warning"]
    # Within the hold-off the field is held, so the rules leave it out of the recommendations.
    assert held_fields(status, now + timedelta(seconds=3599)) == {"enablePrefixCaching"}
    assert held_fields(status, now + timedelta(seconds=3600)) == set()
    later = decide(SPEC, status, [], None, SPEC_VALUES, now + timedelta(seconds=3600))
    assert later.status.hold_offs == []


def test_a_failed_canary_rolls_back_at_once() -> None:
    evidence = TrialEvidence(None, canary_failure="oomEvents: 1 out-of-memory termination(s)")
    decision = decide(SPEC, started(), [], evidence, SPEC_VALUES, T0 + timedelta(seconds=30))
    assert decision.status.history[0].outcome == "RolledBack"
    assert "the canary failed (oomEvents" in decision.events[0].message


def noisy() -> TrialEvidence:
    """A +5% gain within a spread of half the mean: a window cannot tell."""
    spread = [500.0, 1500.0] * 5
    return TrialEvidence(compare([v * 1.05 for v in spread], spread))


def test_a_window_that_cannot_decide_extends_the_trial_once_then_ends_it_inconclusive() -> None:
    status = started()
    assert noisy().comparison is not None and noisy().comparison.verdict == "Inconclusive"
    extended = decide(SPEC, status, [], noisy(), SPEC_VALUES, T0 + timedelta(seconds=600))
    trial = extended.status.trial
    assert trial is not None and trial.looks == 1
    assert trial.extended_because is not None
    assert trial.extended_because.startswith("+5.0% tokens/s is not yet significant (p = ")
    assert extended.status.history == []
    [event] = extended.events
    assert (event.type, event.reason) == ("Normal", "TuningTrialExtended")
    assert event.message.startswith("enablePrefixCaching true -> false runs on: the window could")
    assert event.message.endswith("it is judged again over 2 windows (1200s)")
    # Judged once a look: not again until the extended window has run.
    later = extended.status
    waiting = decide(SPEC, later, [], win(), SPEC_VALUES, T0 + timedelta(seconds=1199))
    assert (waiting.status.trial, waiting.events) == (later.trial, [])
    ended = decide(SPEC, later, [], noisy(), SPEC_VALUES, T0 + timedelta(seconds=1200))
    [record] = ended.status.history
    assert (record.outcome, ended.status.trial) == ("Inconclusive", None)
    assert record.message.startswith(
        "enablePrefixCaching true -> false inconclusive, rolled back: +5.0% tokens/s is not yet"
    )
    assert {e.name for e in record.evidence} >= {"improvement", "noise", "pValue"}
    assert [(e.type, e.reason) for e in ended.events] == [("Warning", "TuningTrialInconclusive")]
    # Held off for a quarter of holdOffSeconds (3600 s), not the loss's whole.
    assert [(h.field, format_time(h.until)) for h in ended.status.hold_offs] == [
        ("enablePrefixCaching", "2026-11-29T01:35:00Z")
    ]


def test_an_extended_trial_that_wins_is_promoted() -> None:
    later = decide(SPEC, started(), [], noisy(), SPEC_VALUES, T0 + timedelta(seconds=600)).status
    won = decide(SPEC, later, [], win(), SPEC_VALUES, T0 + timedelta(seconds=1230))
    assert won.promoted is not None and won.status.history[0].outcome == "Promoted"


def test_without_enough_samples_a_trial_is_extended_then_inconclusive_never_a_loss() -> None:
    waiting = TrialEvidence(None)
    status = started()
    assert decide(SPEC, status, [], waiting, SPEC_VALUES, T0 + timedelta(seconds=599)).events == []
    extended = decide(SPEC, status, [], waiting, SPEC_VALUES, T0 + timedelta(seconds=600))
    assert extended.status.trial is not None and extended.status.trial.looks == 1
    assert extended.status.trial.extended_because == "too few samples after 600s"
    later = extended.status
    assert decide(SPEC, later, [], waiting, SPEC_VALUES, T0 + timedelta(seconds=1199)).events == []
    ended = decide(SPEC, later, [], waiting, SPEC_VALUES, T0 + timedelta(seconds=1200))
    [record] = ended.status.history
    assert (record.outcome, record.evidence) == ("Inconclusive", [])
    assert record.message == (
        "enablePrefixCaching true -> false inconclusive, rolled back: too few samples after 1200s"
    )


def test_a_loss_is_rolled_back_and_says_so() -> None:
    loss = TrialEvidence(compare([v * 0.8 for v in BASE], BASE))
    decision = decide(SPEC, started(), [], loss, SPEC_VALUES, T0 + timedelta(seconds=600))
    [record] = decision.status.history
    assert record.outcome == "RolledBack"
    assert record.message.startswith(
        "enablePrefixCaching true -> false rolled back (loss): -20.0% tokens/s, less than -3%"
    )
    assert [format_time(h.until) for h in decision.status.hold_offs] == ["2026-11-29T02:10:00Z"]


BIG_BUFFER = Recommendation(
    field="fragmentationBuffer", current="auto", proposed="12Gi", rule="fragmentation-buffer",
    expected_effect="x", confidence=0.9, since="2026-11-29T00:00:00Z",
)  # fmt: skip
UNFIT = {"fragmentationBuffer": "the KV cache gets 0.22 GiB (178 blocks) a rank"}


def test_a_candidate_that_does_not_fit_is_skipped_held_off_and_the_next_one_starts() -> None:
    decision = decide(SPEC, TuningStatus(), [BIG_BUFFER, PREFIX_OFF], None, SPEC_VALUES, T0, UNFIT)
    status = decision.status
    [skipped] = status.history
    assert (skipped.field, skipped.proposed, skipped.outcome) == (
        "fragmentationBuffer", "12Gi", "Skipped",
    )  # fmt: skip
    assert skipped.message == (
        "fragmentationBuffer auto -> 12Gi (fragmentation-buffer) skipped: the candidate does not "
        "fit (the KV cache gets 0.22 GiB (178 blocks) a rank)"
    )
    assert [(h.field, format_time(h.until)) for h in status.hold_offs] == [
        ("fragmentationBuffer", "2026-11-29T02:00:00Z")
    ]
    # No canary ran for it, so it is not a change of the day; the next recommendation starts.
    assert status.trial is not None and status.trial.field == "enablePrefixCaching"
    assert status.changes_today == 1
    assert [(e.type, e.reason) for e in decision.events] == [
        ("Warning", "TuningTrialSkipped"), ("Normal", "TuningTrialStarted"),
    ]  # fmt: skip
    assert held_fields(status, T0) == {"fragmentationBuffer", "enablePrefixCaching"}


def test_when_no_candidate_fits_nothing_starts() -> None:
    decision = decide(SPEC, TuningStatus(), [BIG_BUFFER], None, SPEC_VALUES, T0, UNFIT)
    assert decision.status.trial is None and decision.status.changes_today == 0
    assert [e.reason for e in decision.events] == ["TuningTrialSkipped"]
    # Within the hold-off the rules leave the field out, so nothing is skipped twice.
    again = decide(SPEC, decision.status, [], None, SPEC_VALUES, T0 + timedelta(seconds=60), UNFIT)
    assert (again.events, len(again.status.history)) == ([], 1)


def test_a_trial_whose_candidate_stops_fitting_is_rolled_back_at_once() -> None:
    unfit = {"enablePrefixCaching": "the weights need 40.1 GiB of the 39.6 GiB allowed"}
    decision = decide(SPEC, started(), [], None, SPEC_VALUES, T0 + timedelta(seconds=30), unfit)
    status = decision.status
    assert status.trial is None
    assert status.history[0].outcome == "RolledBack"
    assert status.history[0].message == (
        "enablePrefixCaching true -> false rolled back: the candidate does not fit (the weights "
        "need 40.1 GiB of the 39.6 GiB allowed)"
    )
    assert [h.field for h in status.hold_offs] == ["enablePrefixCaching"]
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "TuningRolledBack")]


def test_a_trial_whose_field_the_spec_now_fixes_is_rolled_back_at_once_even_on_a_win() -> None:
    # KV events switched on while prefix caching off was under trial: compose drops the change,
    # so the canary runs the other pods' policy and its window would only measure noise.
    fixed = {"enablePrefixCaching": "spec.gateway.kvEvents"}
    now = T0 + timedelta(seconds=600)
    decision = decide(SPEC, started(), [], win(), SPEC_VALUES, now, None, None, fixed)
    status = decision.status
    assert status.trial is None and status.changes == []
    assert status.history[0].outcome == "RolledBack"
    assert status.history[0].message == (
        "enablePrefixCaching true -> false rolled back: spec.gateway.kvEvents now fixes "
        "enablePrefixCaching at the spec's value, so the canary would run the same policy as the "
        "other pods"
    )
    assert [h.field for h in status.hold_offs] == ["enablePrefixCaching"]
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "TuningRolledBack")]
    # a field the spec does not fix is judged as before
    other = {"maxNumSeqs": "spec.gateway.kvEvents"}
    judged = decide(SPEC, started(), [], win(), SPEC_VALUES, now, None, None, other)
    assert judged.status.history[0].outcome == "Promoted"


STEPPED = Baseline(
    "h2", "a step-down after pod qwen-1's run-time GPU OOM capped gpuMemoryUtilization at 0.85"
)


def started_over(policy_hash: str = "h1") -> TuningStatus:
    decision = decide(
        SPEC, TuningStatus(), [PREFIX_OFF], None, SPEC_VALUES, T0, baseline=Baseline(policy_hash)
    )
    assert decision.status.trial is not None
    return decision.status


def test_a_trial_records_the_baseline_it_starts_over() -> None:
    trial = started_over().trial
    assert trial is not None and trial.baseline_policy_hash == "h1"
    # The same baseline later: the trial waits for its window as before.
    same = decide(SPEC, started_over(), [], win(), SPEC_VALUES, T0 + timedelta(seconds=30),
                  baseline=Baseline("h1"))  # fmt: skip
    assert same.events == [] and same.status.trial == trial


def test_a_trial_whose_baseline_moves_is_rolled_back_at_once_even_on_a_win() -> None:
    now = T0 + timedelta(seconds=600)  # its window is over and the canary measured a win
    decision = decide(SPEC, started_over(), [], win(), SPEC_VALUES, now, baseline=STEPPED)
    status = decision.status
    assert (status.trial, status.changes, decision.promoted) == (None, [], None)
    [record] = status.history
    assert (record.outcome, record.evidence) == ("RolledBack", [])
    assert record.message == (
        "enablePrefixCaching true -> false rolled back: a step-down after pod qwen-1's run-time "
        "GPU OOM capped gpuMemoryUtilization at 0.85 while it ran, so the window would measure "
        "more than its change"
    )
    assert [(e.type, e.reason, e.message) for e in decision.events] == [
        ("Warning", "TuningRolledBack", record.message)
    ]
    # Held like any decided field; the trial still counts against the day's cap.
    assert [(h.field, h.value, format_time(h.until)) for h in status.hold_offs] == [
        ("enablePrefixCaching", "true", "2026-11-29T02:10:00Z")
    ]
    assert status.changes_today == 1
    assert held_fields(status, now + timedelta(seconds=3599)) == {"enablePrefixCaching"}


def test_the_next_trial_starts_over_the_new_baseline() -> None:
    now = T0 + timedelta(seconds=30)
    rolled = decide(SPEC, started_over(), [], None, SPEC_VALUES, now, baseline=STEPPED).status
    # The held field is left out of the recommendations; another one starts over "h2".
    decision = decide(SPEC, rolled, [BIG_BUFFER], None, SPEC_VALUES, now, baseline=STEPPED)
    trial = decision.status.trial
    assert trial is not None
    assert (trial.field, trial.baseline_policy_hash) == ("fragmentationBuffer", "h2")
    assert decision.status.changes_today == 2


def test_a_trial_without_a_recorded_baseline_is_judged_as_before() -> None:
    """A trial started before baselines were recorded (or a caller that knows none)."""
    legacy = started()  # no baseline given: none recorded
    assert legacy.trial is not None and legacy.trial.baseline_policy_hash is None
    now = T0 + timedelta(seconds=600)
    decision = decide(SPEC, legacy, [], win(), SPEC_VALUES, now, baseline=STEPPED)
    assert [e.reason for e in decision.events] == ["TuningPromoted"]
    unknown = decide(SPEC, started_over(), [], win(), SPEC_VALUES, now, baseline=None)
    assert [e.reason for e in unknown.events] == ["TuningPromoted"]
