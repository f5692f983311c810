"""spec.lifecycle.maxPodAge: the duration's validation, each pod's fixed due time, the decision's
checks in order with their boundaries, and status.lifecycle after a round."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from pagekeeper_operator.api.lifecycle import (
    BOUNDS_RULE,
    FORMAT_RULE,
    LifecycleSpec,
    LifecycleStatus,
    format_age,
    parse_duration,
)
from pagekeeper_operator.controllers.pod_age_loop import lifecycle_status, server_ages
from pagekeeper_operator.rollout.pod_age import (
    AgedPod,
    AgeVerdict,
    HoldReason,
    ServerAges,
    decide_age,
    due_at,
    is_rollout_complete,
    spread_of,
)
from tests.operator.servers import make_server

CREATED = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
DAY = timedelta(hours=24)
# Each uid's due time under maxPodAge 24h, all three created at CREATED (`due_at`'s scheme,
# pinned: every operator process and version must agree on it).
DUE = {
    "uid-a": datetime(2026, 3, 2, 10, 11, 2, 504599, tzinfo=UTC),
    "uid-c": datetime(2026, 3, 2, 10, 46, 48, 801295, tzinfo=UTC),
    "uid-b": datetime(2026, 3, 2, 11, 19, 25, 772650, tzinfo=UTC),
}


def pod(uid: str, **changes: Any) -> AgedPod:
    base = AgedPod(
        name=f"chat-{uid[-1:]}", uid=uid, created_at=CREATED, is_ready=True,
        is_terminating=False, is_canary=False,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def ages(**changes: Any) -> ServerAges:
    base = ServerAges(
        max_age=DAY,
        pods=(pod("uid-a"), pod("uid-b"), pod("uid-c")),
        num_desired=3,
        max_unavailable=1,
        cooldown=timedelta(minutes=10),
        last_action_at=None,
        is_canary_running=False,
        is_rollout_complete=True,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400), ("90m", 5400), ("1h30m", 5400), ("1m", 60), ("2h3m4s", 7384)],
)
def test_durations_parse(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)
    assert LifecycleSpec(maxPodAge=text).max_age == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1d", FORMAT_RULE["message"]),
        ("30m1h", FORMAT_RULE["message"]),
        ("1.5h", FORMAT_RULE["message"]),
        ("59s", BOUNDS_RULE["message"]),
        ("8761h", BOUNDS_RULE["message"]),
    ],
)
def test_bad_durations_are_refused_naming_the_field(text: str, message: str) -> None:
    assert parse_duration(text) is None or message == BOUNDS_RULE["message"]
    with pytest.raises(ValidationError) as info:
        LifecycleSpec(maxPodAge=text)
    assert message in str(info.value)
    assert message.startswith("spec.lifecycle.maxPodAge must")


def test_unset_is_off_and_the_spec_carries_it() -> None:
    assert make_server().spec.lifecycle.max_age is None
    server = make_server({"lifecycle": {"maxPodAge": "12h"}})
    assert server.spec.lifecycle.max_age == timedelta(hours=12)
    assert decide_age(ages(max_age=None), CREATED + 2 * DAY).verdict is AgeVerdict.OFF


def test_format_age() -> None:
    assert format_age(timedelta(hours=1, minutes=2, seconds=3)) == "1h2m3s"
    assert format_age(timedelta(minutes=5)) == "5m"
    assert format_age(timedelta(0)) == "0s"


def test_due_times_are_fixed_by_the_uid_and_spread_over_a_tenth_of_the_age() -> None:
    for uid, due in DUE.items():
        assert due_at(pod(uid), DAY) == due
        assert due_at(pod(uid, name="other-name"), DAY) == due  # the uid alone decides
        assert CREATED + DAY * 0.9 < due <= CREATED + DAY
    # no uid: the name decides
    assert spread_of(pod("", name="chat-x")) == spread_of(pod("chat-x", name="other"))


def test_no_pod_is_due_before_the_first_due_time() -> None:
    decision = decide_age(ages(), DUE["uid-a"] - timedelta(seconds=1))
    assert decision.verdict is AgeVerdict.NONE_DUE
    assert decision.pod is None
    assert decision.oldest_created_at == CREATED
    assert decision.next_due_at == DUE["uid-a"]
    assert decision.message == "no pod is due before 2026-03-02T10:11:02Z"


def test_the_pod_due_first_is_replaced_and_the_next_due_is_reported() -> None:
    now = DUE["uid-b"] + timedelta(minutes=1)  # all three due
    decision = decide_age(ages(), now)
    assert decision.verdict is AgeVerdict.REPLACE
    assert decision.pod is not None and decision.pod.name == "chat-a"
    assert decision.due_at == DUE["uid-a"]
    assert decision.next_due_at == DUE["uid-c"]
    assert decision.message == (
        "chat-a is 23h20m25s old, due since 2026-03-02T10:11:02Z (maxPodAge 24h)"
    )


@pytest.mark.parametrize(
    ("changes", "reason", "why"),
    [
        ({"is_canary_running": True}, HoldReason.CANARY, "a canary is under way"),
        (
            {"is_rollout_complete": False},
            HoldReason.ROLLOUT,
            "the Deployment's rollout is not complete",
        ),
        (
            {"last_action_at": DUE["uid-a"]},
            HoldReason.COOLDOWN,
            "cooldown until 2026-03-02T10:21:02Z",
        ),
        (
            {"pods": (pod("uid-a"), pod("uid-b", is_ready=False), pod("uid-c"))},
            HoldReason.MAX_UNAVAILABLE,
            "1 of 3 pods unavailable, maxUnavailable 1",
        ),
        (
            {"num_desired": 4},  # one not yet created
            HoldReason.MAX_UNAVAILABLE,
            "1 of 4 pods unavailable, maxUnavailable 1",
        ),
    ],
)
def test_a_due_pod_waits(changes: dict[str, Any], reason: HoldReason, why: str) -> None:
    now = DUE["uid-a"] + timedelta(minutes=5)
    decision = decide_age(ages(**changes), now)
    assert decision.verdict is AgeVerdict.WAIT
    assert decision.reason is reason
    assert decision.pod is not None and decision.pod.name == "chat-a"
    assert decision.next_due_at == DUE["uid-a"]
    assert decision.message.endswith(f"; waiting: {why}")


def test_the_checks_apply_in_order() -> None:
    now = DUE["uid-a"] + timedelta(minutes=5)
    everything = ages(is_canary_running=True, is_rollout_complete=False, last_action_at=now)
    assert decide_age(everything, now).reason is HoldReason.CANARY
    no_canary = dataclasses.replace(everything, is_canary_running=False)
    assert decide_age(no_canary, now).reason is HoldReason.ROLLOUT


def test_cooldown_boundary() -> None:
    last = DUE["uid-a"]
    state = ages(last_action_at=last)
    end = last + timedelta(minutes=10)
    assert decide_age(state, end - timedelta(seconds=1)).reason is HoldReason.COOLDOWN
    assert decide_age(state, end).verdict is AgeVerdict.REPLACE


def test_a_pod_that_is_not_ready_may_go_while_another_is_down() -> None:
    # chat-a is due and not ready: replacing it takes nothing more away.
    pods = (pod("uid-a", is_ready=False), pod("uid-b"), pod("uid-c"))
    decision = decide_age(ages(pods=pods), DUE["uid-a"] + timedelta(minutes=1))
    assert decision.verdict is AgeVerdict.REPLACE
    assert decision.pod is not None and decision.pod.name == "chat-a"


def test_canary_and_terminating_pods_are_neither_replaced_nor_the_oldest() -> None:
    pods = (
        pod("uid-a", is_terminating=True),
        pod("uid-b", is_canary=True, created_at=CREATED - DAY),
        pod("uid-c", created_at=CREATED + timedelta(hours=1)),
    )
    now = CREATED + 2 * DAY
    decision = decide_age(ages(pods=pods, num_desired=1), now)
    assert decision.oldest_created_at == CREATED + timedelta(hours=1)
    assert decision.pod is not None and decision.pod.name == "chat-c"
    # The pod going away is down: replacing chat-c too would put two down.
    assert decision.reason is HoldReason.MAX_UNAVAILABLE


def test_max_unavailable_two_lets_a_second_go() -> None:
    pods = (pod("uid-a"), pod("uid-b", is_terminating=True), pod("uid-c"))
    state = ages(pods=pods, max_unavailable=2)
    decision = decide_age(state, DUE["uid-b"] + timedelta(minutes=1))
    assert decision.verdict is AgeVerdict.REPLACE
    assert decision.pod is not None and decision.pod.name == "chat-a"


def deployment(**status: int) -> dict[str, Any]:
    full = {"observedGeneration": 2, "replicas": 3, "updatedReplicas": 3, "availableReplicas": 3}
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": 3},
        "status": full | status,
    }


@pytest.mark.parametrize(
    ("status", "is_complete"),
    [
        ({}, True),
        ({"observedGeneration": 1}, False),
        ({"updatedReplicas": 2}, False),
        ({"replicas": 4}, False),  # an old pod still there
        ({"availableReplicas": 2}, False),
    ],
)
def test_rollout_complete(status: dict[str, int], is_complete: bool) -> None:
    assert is_rollout_complete(deployment(**status)) is is_complete
    assert is_rollout_complete(None) is False


def pod_body(name: str, uid: str, *, ready: bool = True, canary: bool = False) -> dict[str, Any]:
    labels = {"pagekeeper.dev/llmserver": "qwen"}
    if canary:
        labels["pagekeeper.dev/canary"] = "true"
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": uid,
            "creationTimestamp": "2026-03-01T12:00:00Z",
            "labels": labels,
            "ownerReferences": [{"kind": "ReplicaSet", "name": "qwen-1", "controller": True}],
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_server_ages_from_the_api_objects() -> None:
    server = make_server(
        {
            "replicas": 3,
            "lifecycle": {"maxPodAge": "24h"},
            "remediation": {"cooldownSeconds": 120, "maxUnavailable": 2},
        }
    )
    pods = [
        pod_body("qwen-a", "uid-a"),
        pod_body("qwen-b", "uid-b", ready=False),
        pod_body("qwen-c", "uid-c", canary=True),
        {**pod_body("stray", "uid-s"), "metadata": {"name": "stray", "labels": {}}},
    ]
    state = server_ages(server, pods, deployment(), CREATED, evicting=["qwen-a"])
    assert state.max_age == DAY
    assert [(p.name, p.is_ready, p.is_terminating, p.is_canary) for p in state.pods] == [
        ("qwen-a", True, True, False),
        ("qwen-b", False, False, False),
        ("qwen-c", True, False, True),
    ]
    assert (state.num_desired, state.max_unavailable) == (3, 2)
    assert state.cooldown == timedelta(minutes=2)
    assert state.last_action_at == CREATED
    assert state.is_canary_running is True
    assert state.is_rollout_complete is True


def test_status_after_a_replacement_a_wait_and_a_refusal() -> None:
    now = DUE["uid-b"] + timedelta(minutes=1)
    replaced = decide_age(ages(), now)
    status = lifecycle_status(None, replaced, replaced=("chat-a", now))
    assert status == LifecycleStatus(
        oldestPodCreatedAt=CREATED,
        nextDueAt=DUE["uid-c"],
        lastReplacedPod="chat-a",
        lastReplacedAt=now,
        waitingPod=None,
        reason="",
        message=replaced.message,
    )
    waiting = decide_age(ages(is_canary_running=True), now)
    after = lifecycle_status(status, waiting)
    assert after is not None
    assert (after.last_replaced_pod, after.waiting_pod, after.reason) == (
        "chat-a",
        "chat-a",
        "canary",
    )
    refused = lifecycle_status(status, replaced, refused=("pdb-blocked", "a budget said no"))
    assert refused is not None
    assert (refused.waiting_pod, refused.reason, refused.message) == (
        "chat-a",
        "pdb-blocked",
        "a budget said no",
    )
    assert lifecycle_status(status, decide_age(ages(max_age=None), now)) is None


def test_a_replacement_reports_the_oldest_of_the_pods_that_stay() -> None:
    pods = (
        pod("uid-a", created_at=CREATED - timedelta(hours=2)),
        pod("uid-b", created_at=CREATED + timedelta(hours=1)),
        pod("uid-c", created_at=CREATED + timedelta(hours=3)),
    )
    decision = decide_age(ages(pods=pods), CREATED + DAY)
    assert decision.verdict is AgeVerdict.REPLACE
    assert decision.pod is not None and decision.pod.name == "chat-a"
    assert decision.oldest_created_at == CREATED + timedelta(hours=1)
