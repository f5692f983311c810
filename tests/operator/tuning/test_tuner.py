"""One tuning step: recommendations and their Events, accepting one by annotation, Apply mode's
trial and the canary's candidate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.rollout import CanaryStatus
from pagekeeper_operator.api.tuning import StepDownCaps
from pagekeeper_operator.policy.adaptive import OOMClassification
from pagekeeper_operator.policy.effective import compose, memory_policy_hash
from pagekeeper_operator.remediation.oom import respond_to_oom
from pagekeeper_operator.rollout.canary import decide_canary
from pagekeeper_operator.status.conditions import compute_status
from pagekeeper_operator.timestamps import format_time
from pagekeeper_operator.tuning.compare import compare
from pagekeeper_operator.tuning.decide import TrialEvidence
from pagekeeper_operator.tuning.observe import num_samples
from pagekeeper_operator.tuning.step import (
    TRIAL_ANALYSIS_SECONDS,
    WindowCache,
    canary_failure,
    is_covered,
    promote_canary,
    trial_canary_spec,
)
from pagekeeper_operator.tuning.tuner import (
    ACCEPT_ANNOTATION,
    NO_CHANGE_MESSAGE,
    NO_FIT_MESSAGE,
    Observation,
    TuneResult,
    baseline_change,
    caps_text,
    tune,
)
from tests.operator.servers import make_server, merge
from tests.operator.tuning.test_rules import window

T0 = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
BASELINE = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1002.0, 998.0, 1001.0]
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
    assert (rec.field, rec.proposed, format_time(rec.since)) == (
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


def test_no_prefix_caching_off_is_recommended_while_kv_events_are_on() -> None:
    server = make_server({"gateway": {"kvEvents": {"enabled": True}}})
    result = tune(server, NO_REUSE, T0)
    assert result.recommendations == []
    assert result.events == []
    assert result.tuning is not None
    assert result.tuning.message == (
        f"{NO_CHANGE_MESSAGE}; spec.gateway.kvEvents fixes enablePrefixCaching"
    )


def test_a_recommendation_that_does_not_fit_is_dropped_with_the_plans_reason() -> None:
    server = make_server()
    checked: list[str | None] = []

    def does_not_fit(trying: LLMServer, policy: MemoryPolicy) -> str | None:
        value = policy.enable_prefix_caching
        checked.append(str(value))
        return "the KV cache gets 0 blocks" if value is False else None

    result = tune(server, NO_REUSE, T0, does_not_fit)
    assert checked == ["False"]  # the candidate, with the recommendation's change
    assert result.recommendations == []
    assert result.tuning is not None
    [dropped] = result.tuning.dropped
    assert (dropped.field, dropped.current, dropped.proposed, dropped.rule, dropped.reason) == (
        "enablePrefixCaching", "true", "false", "prefix-caching-off", "the KV cache gets 0 blocks",
    )  # fmt: skip
    assert result.tuning.message == NO_FIT_MESSAGE
    assert [(e.type, e.reason, e.message) for e in result.events] == [(
        "Warning", "TuningRecommendationDropped",
        "enablePrefixCaching true -> false (prefix-caching-off) is not recommended: the candidate "
        "does not fit (the KV cache gets 0 blocks)",
    )]  # fmt: skip
    # The same verdict next time posts nothing again; without a window it stays as it was.
    again = tune(after(server, result), NO_REUSE, T0.replace(hour=2), does_not_fit)
    assert (again.events, again.tuning) == ([], result.tuning)
    blind = tune(after(server, result), Observation(None, error="no Prometheus"), T0)
    assert blind.tuning is not None and blind.tuning.dropped == result.tuning.dropped
    fits = tune(server, NO_REUSE, T0, lambda _server, _policy: None)
    assert [r.field for r in fits.recommendations] == ["enablePrefixCaching"]
    assert fits.tuning is not None and fits.tuning.dropped == []
    assert [e.reason for e in fits.events] == ["TuningRecommendation"]


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
    assert compose(trying).rendered.enable_prefix_caching is False
    assert trial_canary_spec(trying).analysis_seconds == TRIAL_ANALYSIS_SECONDS
    assert trial_canary_spec(server).analysis_seconds == 1800


def test_a_host_step_down_names_the_kill_and_the_tiers_cap() -> None:
    tiered = make_server({"memoryPolicy": {"kvOffload": {"size": "16Gi"}}})
    stepped = out_of_memory(tiered, "qwen-7d9f8-abcde", T0, oom=HOST_KILL)
    assert baseline_change(stepped, compose(stepped)) == (
        "a step-down after pod qwen-7d9f8-abcde's host OOM kill (OOMKilled) capped "
        "kvOffload.size at 8Gi"
    )


def test_the_caps_in_words_name_every_capped_term() -> None:
    both = StepDownCaps(
        gpu_memory_utilization=0.85, max_num_batched_tokens=4096, spec_memory_policy_hash="h"
    )
    assert caps_text(both) == "gpuMemoryUtilization at 0.85 and maxNumBatchedTokens at 4096"
    tier = StepDownCaps(kv_offload_size="8Gi", spec_memory_policy_hash="h")
    assert caps_text(tier) == "kvOffload.size at 8Gi"
    off = StepDownCaps(kv_offload_size="0", spec_memory_policy_hash="h")
    assert caps_text(off) == "kvOffload off"


def test_a_won_trial_promotes_the_canary_record() -> None:
    analyzing = CanaryStatus(
        phase="Analyzing", template_hash="c", stable_template_hash="s",
        started_at="2026-11-29T01:00:00Z",
    )  # fmt: skip
    promoted = promote_canary(analyzing, datetime(2026, 11, 29, 1, 10, tzinfo=UTC))
    assert promoted is not None
    assert (promoted.phase, format_time(promoted.finished_at)) == (
        "Promoted",
        "2026-11-29T01:10:00Z",
    )
    assert promote_canary(None, T0) is None


def test_a_window_is_asked_for_again_after_an_eighth_of_it_or_when_its_inputs_change() -> None:
    cache = WindowCache()
    key, seen = ("ml", "qwen"), window("chat_steady")
    cache.put(key, "inputs", T0, seen)
    assert cache.get(key, "inputs", 900, T0 + timedelta(seconds=111)) is seen
    assert cache.get(key, "inputs", 900, T0 + timedelta(seconds=112)) is None  # 900 // 8
    assert cache.get(key, "an alert fired", 900, T0) is None
    assert cache.get(("ml", "other"), "inputs", 900, T0) is None
    assert cache.get(key, "inputs", 60, T0 + timedelta(seconds=7)) is None


APPLY: dict[str, Any] = {
    "replicas": 3,
    "rollout": {"canary": {"enabled": True}},
    "tuning": {"mode": "Apply", "windowSeconds": 600, "holdOffSeconds": 3600},
}
WON = TrialEvidence(compare([v * 1.1 for v in BASELINE], BASELINE))


def written(server: LLMServer, result: TuneResult, now: datetime) -> LLMServer:
    """The server once its reconcile wrote status: the step's, then the composed policy."""
    stepped = after(server, result)
    status = compute_status(stepped, None, format_time(now))
    return stepped.model_copy(update={"status": status})


GPU_RUNTIME = OOMClassification("gpu", "runtime", "CUDA out of memory")
HOST_KILL = OOMClassification("host", "unknown", "the container exceeded its memory limit")


def out_of_memory(
    server: LLMServer,
    pod: str,
    now: datetime,
    outcome: str = "applied",
    oom: OOMClassification = GPU_RUNTIME,
) -> LLMServer:
    """The server once remediation recorded `oom` (a run-time GPU OOM unless given) of `pod`
    (`remediation.oom`)."""
    body = server.to_api()
    response = respond_to_oom(body, pod, oom, f"k-{pod}", format_time(now), now)
    assert response is not None and response.record.outcome == outcome
    body["status"] = {**body["status"], **response.status}
    return LLMServer.from_body(body)


def trying(now: datetime = T0) -> LLMServer:
    server = make_server(APPLY)
    result = tune(server, NO_REUSE, now)
    assert result.tuning is not None and result.tuning.trial is not None
    assert result.tuning.trial.baseline_policy_hash == memory_policy_hash(compose(server).policy)
    return written(server, result, now)


@pytest.mark.parametrize("pod", ["qwen-7d9f8-abcde"])
def test_a_step_down_during_a_trial_rolls_it_back_and_holds_the_field(pod: str) -> None:
    """A run-time OOM of a baseline pod steps the baseline down: the canary's candidate would
    change with it and the window would compare more than the change."""
    server = trying()
    now = T0 + timedelta(seconds=30)
    stepped = out_of_memory(server, pod, now)
    result = tune(stepped, Observation(window("chat_steady"), TrialEvidence(None)), now)
    tuning = result.tuning
    assert tuning is not None and tuning.trial is None and result.promoted is None
    [record] = tuning.history
    assert record.outcome == "RolledBack"
    assert record.message == (
        f"enablePrefixCaching true -> false rolled back: a step-down after pod {pod}'s run-time "
        "GPU OOM capped gpuMemoryUtilization at 0.85 while it ran, so the window would measure "
        "more than its change"
    )
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "TuningRolledBack")]
    assert [(h.field, format_time(h.until)) for h in tuning.hold_offs] == [
        ("enablePrefixCaching", "2026-11-29T02:00:30Z")
    ]
    # The pods now render the stepped-down policy, without the trial's change.
    done = written(stepped, result, now)
    assert compose(done).trial_policy is None
    policy = compose(done).policy
    assert (policy.gpu_memory_utilization, policy.enable_prefix_caching) == (0.85, True)
    assert trial_canary_spec(done).analysis_seconds == 1800  # the step-down's own canary
    # Within the hold-off the field is neither recommended nor tried again.
    later = tune(done, NO_REUSE, now + timedelta(seconds=600))
    assert later.recommendations == [] and later.events == []
    assert later.tuning is not None and later.tuning.trial is None


def test_a_spec_change_during_a_trial_rolls_it_back() -> None:
    server = trying()
    body = server.to_api()
    body["spec"] = merge(body["spec"], {"memoryPolicy": {"maxNumSeqs": 128}})
    now = T0 + timedelta(seconds=30)
    result = tune(LLMServer.from_body(body), Observation(window("chat_steady")), now)
    assert result.tuning is not None and result.tuning.trial is None
    assert result.tuning.history[0].message == (
        "enablePrefixCaching true -> false rolled back: spec.memoryPolicy changed while it ran, "
        "so the window would measure more than its change"
    )


def test_kv_events_switched_on_during_a_caching_off_trial_roll_it_back_at_once() -> None:
    """The effective policy is unchanged (the baseline did not move), but compose now drops the
    trial's change, so the canary would run the other pods' policy."""
    server = trying()
    body = server.to_api()
    body["spec"] = merge(body["spec"], {"gateway": {"kvEvents": {"enabled": True}}})
    publishing = LLMServer.from_body(body)
    composed = compose(publishing)
    assert composed.trial_policy == composed.policy  # the change is dropped
    now = T0 + timedelta(seconds=30)
    result = tune(publishing, Observation(window("chat_steady"), TrialEvidence(None)), now)
    tuning = result.tuning
    assert tuning is not None and tuning.trial is None and result.promoted is None
    assert tuning.history[0].outcome == "RolledBack"
    assert tuning.history[0].message == (
        "enablePrefixCaching true -> false rolled back: spec.gateway.kvEvents now fixes "
        "enablePrefixCaching at the spec's value, so the canary would run the same policy as the "
        "other pods"
    )
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "TuningRolledBack")]


def test_a_trial_over_a_steady_baseline_runs_its_window() -> None:
    server = trying()
    assert server.status.tuning is not None
    waiting = tune(server, Observation(window("chat_steady"), WON), T0 + timedelta(seconds=599))
    assert waiting.tuning is not None and waiting.tuning.trial == server.status.tuning.trial
    assert waiting.events == []
    done = tune(server, Observation(window("chat_steady"), WON), T0 + timedelta(seconds=600))
    assert [e.reason for e in done.events] == ["TuningPromoted"]


def test_a_promoted_value_is_not_proposed_back_until_its_hold_off_ends() -> None:
    """A -> B -> A only after holdOffSeconds: the window that would undo a promotion is
    ignored for that field until the hold-off ends, however often it comes."""
    server = trying()  # T0: enablePrefixCaching true -> false on the canary
    promoted_at = T0 + timedelta(seconds=600)
    result = tune(server, Observation(window("chat_steady"), WON), promoted_at)
    assert result.promoted is not None
    server = written(server, result, promoted_at)
    assert compose(server).policy.enable_prefix_caching is False
    # The window now shows prompts that repeat earlier ones' blocks: prefix-caching-on.
    reuse = Observation(window("rag_caching_off"))
    for seconds in (1, 1800, 3599):
        now = promoted_at + timedelta(seconds=seconds)
        held = tune(server, reuse, now)
        assert (held.recommendations, held.events) == ([], [])
        assert held.tuning is not None and held.tuning.trial is None
        server = written(server, held, now)
    back_at = promoted_at + timedelta(seconds=3600)
    back = tune(server, reuse, back_at)
    assert [(r.field, r.current, r.proposed, r.rule) for r in back.recommendations] == [
        ("enablePrefixCaching", "false", "true", "prefix-caching-on")
    ]
    assert back.tuning is not None and back.tuning.trial is not None
    trial = back.tuning.trial
    assert (trial.current, trial.proposed, format_time(trial.started_at)) == (
        "false", "true", "2026-11-29T02:10:00Z",
    )  # fmt: skip
    assert [e.reason for e in back.events] == ["TuningRecommendation", "TuningTrialStarted"]


def test_a_replaced_canary_pod_makes_the_trial_wait_for_full_coverage_again() -> None:
    """Remediation evicted a canary pod for an alert outside failOn: the Deployment replaced
    it, and the window holds both pods' short series (16 samples a window, 12 needed)."""
    assert num_samples(600) == 16
    evicted, successor = "qwen-canary-5c6b7-fghij", "qwen-canary-5c6b7-klmno"
    assert is_covered({evicted: [100.0] * 16}, 600)
    assert not is_covered({evicted: [100.0] * 9, successor: [100.0] * 7}, 600)
    # The successor has served three quarters of the window; the evicted pod is still in it.
    assert not is_covered({evicted: [100.0] * 4, successor: [100.0] * 12}, 600)
    # A window after the eviction, only the successor is left, and it covers the window.
    assert is_covered({successor: [100.0] * 16}, 600)
    assert not is_covered({}, 600)


def evicted_canary(alert: str) -> CanaryStatus | None:
    """The trial's canary once remediation evicted one of its pods for `alert`."""
    server = trying()
    analyzing = CanaryStatus(
        phase="Analyzing", template_hash="c", stable_template_hash="s", started_at=format_time(T0)
    )
    record = RemediationRecord.model_validate(
        {"time": "2026-11-29T01:05:00Z", "pod": "qwen-canary-5c6b7-fghij", "alert": alert,
         "action": "evict", "outcome": "evicted"}
    )  # fmt: skip
    plan = decide_canary(
        trial_canary_spec(server), replicas=3, max_surge=0, candidate="c", stable="s",
        previous=analyzing, pods=[], history=[record], server_name="qwen",
        now=T0 + timedelta(seconds=301),
    )  # fmt: skip
    return plan.status


def test_a_canary_pod_evicted_for_a_fail_on_alert_rolls_the_trial_back() -> None:
    server = trying()
    failed = evicted_canary("PagekeeperFragmentationHigh")
    assert failed is not None and failed.phase == "Failed"
    server = server.model_copy(
        update={"status": server.status.model_copy(update={"canary": failed})}
    )
    now = T0 + timedelta(seconds=330)
    failure = canary_failure(server, now)
    assert failure == (
        "fragmentation: PagekeeperFragmentationHigh fired for canary pod qwen-canary-5c6b7-fghij"
    )
    result = tune(server, Observation(window("chat_steady"), TrialEvidence(None, failure)), now)
    assert result.tuning is not None and result.tuning.trial is None
    assert result.tuning.history[0].message == (
        f"enablePrefixCaching true -> false rolled back: the canary failed ({failure})"
    )
    # An eviction for an alert outside failOn leaves the canary, and the trial, running.
    backlog = evicted_canary("PagekeeperQueueBacklog")
    assert backlog is not None and backlog.phase == "Analyzing"
    waiting = server.model_copy(
        update={"status": server.status.model_copy(update={"canary": backlog})}
    )
    assert canary_failure(waiting, now) is None


def test_a_canary_pod_out_of_memory_rolls_the_trial_back_and_steps_nothing_down() -> None:
    """The canary ran the trial's change: its OOM is evidence against that change alone. The
    trial ends on it whatever failOn lists, and the baseline keeps its policy."""
    server = trying()
    now = T0 + timedelta(seconds=30)
    pod = "qwen-canary-5c6b7-fghij"
    oom = out_of_memory(server, pod, now, outcome="not-applicable")
    assert compose(oom).policy == compose(server).policy  # nothing stepped down
    without = oom.spec.rollout.canary.model_copy(update={"fail_on": ["restarts"]})
    rollout = oom.spec.rollout.model_copy(update={"canary": without})
    oom = oom.model_copy(update={"spec": oom.spec.model_copy(update={"rollout": rollout})})
    failure = canary_failure(oom, now)
    assert failure == f"canary pod {pod} ended (gpu-runtime) at 2026-11-29T01:00:30Z"
    result = tune(oom, Observation(window("chat_steady"), TrialEvidence(None, failure)), now)
    tuning = result.tuning
    assert tuning is not None and tuning.trial is None and result.promoted is None
    assert tuning.history[0].outcome == "RolledBack"
    assert tuning.history[0].message == (
        f"enablePrefixCaching true -> false rolled back: the canary failed ({failure})"
    )
    assert [h.field for h in tuning.hold_offs] == ["enablePrefixCaching"]
    # An OOM from before the trial started is no evidence against it.
    earlier = out_of_memory(make_server(APPLY), pod, T0 - timedelta(seconds=5), "applied")
    later = written(earlier, tune(earlier, NO_REUSE, T0), T0)
    assert later.status.tuning is not None and later.status.tuning.trial is not None
    assert later.status.remediation_history[0].pod == pod
    assert canary_failure(later, now) is None
