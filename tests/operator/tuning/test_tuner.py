"""One tuning step: recommendations and their Events, accepting one by annotation, Apply mode's
trial and the canary's candidate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.rollout import CanaryStatus
from pagekeeper_operator.effective import compose
from pagekeeper_operator.tuning.step import (
    TRIAL_ANALYSIS_SECONDS,
    WindowCache,
    candidate,
    promote_canary,
    trial_canary_spec,
)
from pagekeeper_operator.tuning.tuner import (
    ACCEPT_ANNOTATION,
    NO_CHANGE_MESSAGE,
    Observation,
    TuneResult,
    tune,
)
from tests.operator.servers import make_server
from tests.operator.tuning.test_rules import window

T0 = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
NO_REUSE = Observation(window("no_prefix_reuse"))


def after(server: LLMServer, result: TuneResult, **metadata: Any) -> LLMServer:
    """The server as the API holds it once the step's status is written."""
    status = server.status.model_copy(
        update={"recommendations": result.recommendations, "tuning": result.tuning}
    )
    meta = server.metadata.model_copy(update=metadata)
    return server.model_copy(update={"status": status, "metadata": meta})


def test_a_new_recommendation_posts_one_event_and_then_stays_quiet() -> None:
    server = make_server()
    first = tune(server, NO_REUSE, T0)
    [rec] = first.recommendations
    assert (rec.field, rec.proposed, rec.since) == (
        "enablePrefixCaching",
        "false",
        "2026-11-29T01:00:00Z",
    )
    assert [(e.type, e.reason) for e in first.events] == [("Normal", "TuningRecommendation")]
    assert first.events[0].message.startswith(
        "enablePrefixCaching true -> false (prefix-caching-off, confidence 0.451)"
    )
    assert first.tuning is not None and first.tuning.trial is None
    again = tune(after(server, first), NO_REUSE, T0.replace(hour=2))
    assert again.recommendations == first.recommendations  # same since, same evidence
    assert again.events == []
    assert again.tuning == first.tuning


def test_a_recommendation_that_does_not_fit_says_why_in_status_and_its_event() -> None:
    server = make_server()
    checked: list[str | None] = []

    def does_not_fit(trying: LLMServer) -> str | None:
        value = compose(trying).policy.enable_prefix_caching
        checked.append(str(value))
        return "the KV cache gets 0 blocks" if value is False else None

    result = tune(server, NO_REUSE, T0, does_not_fit)
    [rec] = result.recommendations
    assert checked == ["False"]  # the candidate, with the recommendation's change
    assert rec.does_not_fit == "the KV cache gets 0 blocks"
    assert result.events[0].message.endswith("; it does not fit (the KV cache gets 0 blocks)")
    fits = tune(server, NO_REUSE, T0, lambda _: None)
    assert fits.recommendations[0].does_not_fit is None
    assert "does not fit" not in fits.events[0].message


def test_no_window_says_why() -> None:
    result = tune(make_server(), Observation(None, error="no Prometheus"), T0)
    assert result.recommendations == []
    assert result.tuning is not None and result.tuning.message == "no Prometheus"
    steady = tune(make_server(), Observation(window("chat_steady")), T0)
    assert steady.tuning is not None and steady.tuning.message == NO_CHANGE_MESSAGE


def test_recommendations_outlast_a_missing_window() -> None:
    server = make_server()
    first = tune(server, NO_REUSE, T0)
    blip = tune(after(server, first), Observation(None, error="no metric window: down"), T0)
    assert blip.recommendations == first.recommendations
    assert blip.events == []
    assert blip.tuning is not None and blip.tuning.message == "no metric window: down"


def test_off_mode_observes_nothing() -> None:
    result = tune(make_server({"tuning": {"mode": "Off"}}), NO_REUSE, T0)
    assert (result.recommendations, result.tuning, result.events) == ([], None, [])


def test_an_accepted_recommendation_joins_the_effective_policy_not_the_spec() -> None:
    server = make_server()
    first = tune(server, NO_REUSE, T0)
    accepted = after(server, first, annotations={ACCEPT_ANNOTATION: "enablePrefixCaching"})
    result = tune(accepted, NO_REUSE, T0.replace(hour=2))
    assert [e.reason for e in result.events] == ["RecommendationAccepted"]
    assert result.tuning is not None
    [change] = result.tuning.changes
    assert (change.field, change.value, change.spec_value, change.source) == (
        "enablePrefixCaching",
        "false",
        "true",
        "Accepted",
    )
    # The effective policy runs it; nothing is left to recommend for that field.
    written = after(accepted, result)
    assert compose(written).policy.enable_prefix_caching is False
    assert written.spec.memory_policy.enable_prefix_caching is True
    assert result.recommendations == []
    # Accepting again changes nothing.
    assert tune(written, NO_REUSE, T0.replace(hour=3)).events == []


def test_apply_mode_tries_the_top_recommendation_on_the_canary() -> None:
    server = make_server(
        {"replicas": 3, "rollout": {"canary": {"enabled": True}}, "tuning": {"mode": "Apply"}}
    )
    result = tune(server, NO_REUSE, T0)
    assert [e.reason for e in result.events] == ["TuningRecommendation", "TuningTrialStarted"]
    trying = after(server, result)
    assert trying.status.tuning is not None and trying.status.tuning.trial is not None
    # Pods run the effective policy; the canary's candidate is it plus the trial's change.
    assert compose(trying).policy.enable_prefix_caching is True
    assert compose(candidate(trying)).policy.enable_prefix_caching is False
    assert trial_canary_spec(trying).analysis_seconds == TRIAL_ANALYSIS_SECONDS
    assert trial_canary_spec(server).analysis_seconds == 1800


def test_a_won_trial_promotes_the_canary_record() -> None:
    analyzing = CanaryStatus(
        phase="Analyzing", template_hash="c", stable_template_hash="s",
        started_at="2026-11-29T01:00:00Z",
    )  # fmt: skip
    promoted = promote_canary(analyzing, "2026-11-29T01:10:00Z")
    assert promoted is not None
    assert (promoted.phase, promoted.finished_at) == ("Promoted", "2026-11-29T01:10:00Z")
    assert promote_canary(None, "x") is None


def test_a_window_is_asked_for_again_after_an_eighth_of_it_or_when_its_inputs_change() -> None:
    cache = WindowCache()
    key, seen = ("ml", "qwen"), window("chat_steady")
    cache.put(key, "inputs", T0, seen)
    assert cache.get(key, "inputs", 900, T0 + timedelta(seconds=111)) is seen
    assert cache.get(key, "inputs", 900, T0 + timedelta(seconds=112)) is None  # 900 // 8
    assert cache.get(key, "an alert fired", 900, T0) is None
    assert cache.get(("ml", "other"), "inputs", 900, T0) is None
    assert cache.get(key, "inputs", 60, T0 + timedelta(seconds=7)) is None
