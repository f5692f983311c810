"""The canary decision (pure): start, promote, fail, resume, and what it does not touch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.rollout import CanarySpec, CanaryStatus
from pagekeeper_operator.rollout.canary import (
    CANARY_LABEL,
    CanaryEvent,
    CanaryPlan,
    CanaryPod,
    canary_pod,
    decide_canary,
    shape_deployments,
    template_identity,
)

T0 = datetime(2026, 11, 23, 10, 0, 0, tzinfo=UTC)
SPEC = CanarySpec(enabled=True, replicas=1, analysis_seconds=600)
READY = CanaryPod("qwen-canary-7d9f-abcde", is_ready=True, restarts=0, oom_terminations=0)
ANALYZING = CanaryStatus(
    phase="Analyzing",
    template_hash="new",
    stable_template_hash="old",
    started_at="2026-11-23T10:00:00Z",
    message="1 canary pod(s) run the new template for 600s",
)


def decide(
    *,
    spec: CanarySpec = SPEC,
    candidate: str = "new",
    stable: str | None = "old",
    previous: CanaryStatus | None = ANALYZING,
    pods: tuple[CanaryPod, ...] = (READY,),
    history: tuple[RemediationRecord, ...] = (),
    max_surge: int = 0,
    now: datetime = T0,
) -> CanaryPlan:
    return decide_canary(
        spec,
        replicas=4,
        max_surge=max_surge,
        candidate=candidate,
        stable=stable,
        previous=previous,
        pods=pods,
        history=history,
        server_name="qwen",
        now=now,
    )


def test_a_changed_template_starts_a_canary_in_place_of_one_replica() -> None:
    plan = decide(previous=None, pods=())
    assert plan == CanaryPlan(
        main_runs_candidate=False,
        main_replicas=3,
        canary_replicas=1,
        status=ANALYZING,
        event=CanaryEvent("Normal", "CanaryStarted", ANALYZING.message),
    )
    # with surge allowed the canary is added beside every replica
    assert decide(previous=None, pods=(), max_surge=1).main_replicas == 4


def test_an_analysis_in_progress_resumes_from_status() -> None:
    """What an operator restarted mid-analysis sees: the record, the same template."""
    plan = decide(now=T0 + timedelta(seconds=599))
    assert plan == CanaryPlan(False, 3, 1, ANALYZING, None)


def test_a_clean_analysis_promotes_to_every_replica() -> None:
    plan = decide(now=T0 + timedelta(seconds=600))
    message = "1 canary pod(s) ran clean for 600s: the new template rolls to all 4 replicas"
    assert plan == CanaryPlan(
        True,
        4,
        0,
        ANALYZING.model_copy(
            update={"phase": "Promoted", "finished_at": "2026-11-23T10:10:00Z", "message": message}
        ),
        CanaryEvent("Normal", "CanaryPromoted", message),
    )
    # not before the canary pod is ready
    unready = CanaryPod("qwen-canary-7d9f-abcde", is_ready=False, restarts=0, oom_terminations=0)
    assert decide(pods=(unready,), now=T0 + timedelta(seconds=900)).status == ANALYZING
    # once promoted, the Deployment keeps the new template
    promoted = plan.status
    assert decide(previous=promoted, stable="new") == CanaryPlan(True, 4, 0, promoted, None)


@pytest.mark.parametrize(
    ("pod", "history", "signal", "message"),
    [
        (
            CanaryPod("qwen-canary-7d9f-abcde", True, restarts=1, oom_terminations=1),
            (),
            "oomEvents",
            "oomEvents: 1 out-of-memory or stuck termination(s) of canary pods",
        ),
        (
            CanaryPod("qwen-canary-7d9f-abcde", True, restarts=2, oom_terminations=0),
            (),
            "restarts",
            "restarts: 2 container restart(s) of canary pods",
        ),
        (
            READY,
            (
                RemediationRecord(
                    time="2026-11-23T10:03:00Z",
                    pod="qwen-canary-7d9f-abcde",
                    alert="PagekeeperFragmentationHigh",
                    action="skip",
                    outcome="skipped",
                ),
            ),
            "fragmentation",
            "fragmentation: PagekeeperFragmentationHigh fired for canary pod "
            "qwen-canary-7d9f-abcde",
        ),
    ],
)
def test_a_failing_signal_takes_the_canary_back(
    pod: CanaryPod, history: tuple[RemediationRecord, ...], signal: str, message: str
) -> None:
    plan = decide(pods=(pod,), history=history, now=T0 + timedelta(seconds=200))
    failed = ANALYZING.model_copy(
        update={
            "phase": "Failed",
            "finished_at": "2026-11-23T10:03:20Z",
            "failed_signal": signal,
            "message": message,
        }
    )
    assert plan == CanaryPlan(False, 4, 0, failed, CanaryEvent("Warning", "CanaryFailed", message))
    # the resync never tries the failed template again, and the replicas keep the stable one
    assert decide(previous=failed, pods=()) == CanaryPlan(False, 4, 0, failed, None)


def test_signals_outside_failon_or_before_the_start_or_of_other_pods_do_not_count() -> None:
    only_ooms = CanarySpec(enabled=True, analysis_seconds=600, fail_on=["oomEvents"])
    restarted = CanaryPod("qwen-canary-7d9f-abcde", True, restarts=3, oom_terminations=0)
    assert decide(spec=only_ooms, pods=(restarted,)).status == ANALYZING
    old_alert = RemediationRecord(
        time="2026-11-23T09:59:59Z",
        pod="qwen-canary-1111-aaaaa",
        alert="PagekeeperKVCacheSaturated",
        action="evict",
        outcome="evicted",
    )
    main_pod = old_alert.model_copy(update={"time": "2026-11-23T10:01:00Z", "pod": "qwen-5d8f-x"})
    backlog = old_alert.model_copy(
        update={"time": "2026-11-23T10:01:00Z", "alert": "PagekeeperQueueBacklog"}
    )
    assert decide(history=(old_alert, main_pod, backlog)).status == ANALYZING


def test_changes_that_are_not_the_template_roll_as_today() -> None:
    assert decide(previous=None, candidate="old", stable="old") == CanaryPlan(True, 4, 0, None)
    assert decide(previous=None, stable=None) == CanaryPlan(True, 4, 0, None)  # first create
    off = CanarySpec(enabled=False)
    assert decide(spec=off, previous=None) == CanaryPlan(True, 4, 0, None)
    # a new template while another is analyzed restarts the analysis on the new one
    plan = decide(candidate="newer", now=T0 + timedelta(seconds=30))
    assert plan.status is not None and plan.status.template_hash == "newer"
    assert plan.status.started_at == T0 + timedelta(seconds=30)


def template(policy: str, image: str = "engine:1", labels: dict[str, str] | None = None) -> Any:
    return {
        "metadata": {
            "labels": labels or {},
            "annotations": {"pagekeeper.dev/policy-hash": policy},
        },
        "spec": {"containers": [{"name": "engine", "image": image, "command": ["serve"]}]},
    }


def test_the_template_identity_is_policy_and_image_not_labels() -> None:
    base = template_identity(template("p1"))
    assert template_identity(template("p1", labels={"team": "a"})) == base
    assert template_identity(template("p2")) != base
    assert template_identity(template("p1", image="engine:2")) != base


def test_shaped_deployments_keep_the_stable_template_and_add_the_canary() -> None:
    rendered = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen", "labels": {"a": "b"}},
        "spec": {
            "replicas": 4,
            "selector": {"matchLabels": {"s": "qwen"}},
            "template": template("new", labels={"s": "qwen"}),
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "qwen"}}
    stable = template("old", labels={"s": "qwen"})
    main, canary = shape_deployments([service, rendered], CanaryPlan(False, 3, 1, None), stable)[1:]
    assert main["spec"]["template"] == stable and main["spec"]["replicas"] == 3
    assert canary["metadata"]["name"] == "qwen-canary"
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["selector"]["matchLabels"] == {"s": "qwen", CANARY_LABEL: "true"}
    assert canary["spec"]["template"]["metadata"]["labels"] == {"s": "qwen", CANARY_LABEL: "true"}
    assert template_identity(canary["spec"]["template"]) == template_identity(template("new"))
    assert rendered["spec"]["replicas"] == 4  # the input is not changed


def test_a_canary_pod_is_read_from_its_status() -> None:
    pod = {
        "metadata": {"name": "qwen-canary-7d9f-abcde"},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": 2,
                    "lastState": {
                        "terminated": {"reason": "OOMKilled", "finishedAt": "2026-11-23T10:01:00Z"}
                    },
                    "state": {"running": {}},
                }
            ],
        },
    }
    assert canary_pod(pod) == CanaryPod("qwen-canary-7d9f-abcde", True, 2, 1)
    assert canary_pod({"metadata": {"name": "p"}}) == CanaryPod("p", False, 0, 0)


def test_a_stuck_canary_pod_counts_like_an_out_of_memory_one() -> None:
    stuck = "pagekeeper-stuck last_step_age_s=60.0 running=1 waiting=4 detail=step loop stopped"
    pod = {
        "metadata": {"name": "qwen-canary-7d9f-abcde"},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": 1,
                    "lastState": {
                        "terminated": {
                            "reason": "Error",
                            "message": stuck,
                            "finishedAt": "2026-11-23T10:01:00Z",
                        }
                    },
                    "state": {"running": {}},
                }
            ],
        },
    }
    assert canary_pod(pod) == CanaryPod("qwen-canary-7d9f-abcde", False, 1, 1)


def test_an_unreadable_start_is_refused_where_it_is_read_naming_the_field() -> None:
    """startedAt is a timezone-aware time: text that is not RFC 3339 fails validation (the CRD's
    `format: date-time` has the API server refuse it too), never a silent restart or stall."""
    body = {**ANALYZING.to_api(), "startedAt": "yesterday"}
    with pytest.raises(ValidationError) as refused:
        CanaryStatus.model_validate(body)
    [error] = refused.value.errors()
    assert error["loc"] == ("startedAt",)
    assert "unreadable time stamp 'yesterday' (RFC 3339 expected)" in error["msg"]
    with pytest.raises(ValidationError):
        ANALYZING.model_copy(update={"started_at": "yesterday"})
    with pytest.raises(ValidationError):  # no zone: no time
        CanaryStatus.model_validate({**body, "startedAt": "2026-11-23T10:00:00"})
    # Read as the API writes it, and written back the same.
    assert CanaryStatus.model_validate(ANALYZING.to_api()) == ANALYZING
    assert ANALYZING.to_api()["startedAt"] == "2026-11-23T10:00:00Z"
