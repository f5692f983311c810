"""Remediation across an operator's death: the eviction's intent is in history before the
Eviction API is called, a new process settles an intent left open from the pod, and a deferral
recorded before a restart is not recorded again (tests/crash runs the real kills)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.port import EvictionOutcome
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.timestamps import format_time
from tests.operator.remediation_fakes import NS, SERVER, T0, Clock, FakeCluster, alert_json
from tests.operator.remediation_fakes import message_json as message

KV = "PagekeeperKVCacheSaturated"
COOLDOWN = {"hysteresisSeconds": 0, "cooldownSeconds": 600}


def deliver(remediator: Remediator, *alerts: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    summary = asyncio.run(remediator.handle(WebhookMessage.model_validate(message(*alerts))))
    return [(d["pod"], d["verdict"], d["reason"]) for d in summary["decisions"]]


def history(cluster: FakeCluster) -> list[tuple[str, str, str]]:
    return [(r.pod, r.action, r.outcome) for r in cluster.history]


def intent(pod: str) -> RemediationRecord:
    """What an operator killed between the intent and the eviction's answer leaves."""
    alert = alert_json(pod)
    return RemediationRecord(
        time=format_time(T0),
        pod=pod,
        alert=KV,
        action="evict",
        outcome="evicting",
        message=f"evicting {NS}/{pod} for {KV}",
        fingerprint=alert["fingerprint"],
        alertStartsAt=alert["startsAt"].replace("Z", "+00:00"),
    )


class WatchedCluster(FakeCluster):
    """Records the history as it stood when each eviction was asked for."""

    seen_at_eviction: list[list[tuple[str, str, str]]]

    async def evict(self, namespace: str, pod: str) -> tuple[EvictionOutcome, str]:
        self.seen_at_eviction.append(history(self))
        return await super().evict(namespace, pod)


def test_the_intent_is_in_history_before_the_eviction_and_the_outcome_replaces_it() -> None:
    cluster = WatchedCluster(["chat-a", "chat-b"], spec=COOLDOWN)
    cluster.seen_at_eviction = []
    remediator = Remediator(cluster, clock=Clock())

    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "evict", None)]
    assert cluster.seen_at_eviction == [[("chat-a", "evict", "evicting")]]
    assert history(cluster) == [("chat-a", "evict", "evicted")]


def test_a_restarted_operator_settles_an_intent_whose_pod_went_away() -> None:
    """Killed after the eviction was accepted: the pod is terminating and history holds only
    the intent. The new process records it as evicted, never evicts for that firing again,
    and keeps the cooldown for the next alert."""
    cluster = FakeCluster(["chat-a", "chat-b", "chat-c"], spec=COOLDOWN, history=[intent("chat-a")])
    cluster.pods["chat-a"] = replace(cluster.pods["chat-a"], is_ready=False, is_terminating=True)
    clock = Clock(T0)
    clock.advance(30)
    remediator = Remediator(cluster, clock=clock)

    decisions = deliver(remediator, alert_json("chat-a"), alert_json("chat-b"))
    assert decisions == [("chat-a", "skip", "duplicate"), ("chat-b", "skip", "cooldown")]
    assert cluster.eviction_attempts == []
    assert history(cluster) == [("chat-a", "evict", "evicted"), ("chat-b", "skip", "skipped")]
    assert cluster.history[0].time == T0  # the cooldown counts from the intent


def test_a_restarted_operator_drops_an_intent_never_carried_out() -> None:
    """Killed after the intent, before the Eviction API was called: the pod still serves. The
    intent goes and the re-delivered alert is decided again, evicting the pod once."""
    cluster = FakeCluster(["chat-a", "chat-b"], spec=COOLDOWN, history=[intent("chat-a")])
    remediator = Remediator(cluster, clock=Clock())

    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "evict", None)]
    assert cluster.eviction_attempts == ["chat-a"]
    assert history(cluster) == [("chat-a", "evict", "evicted")]


def test_resume_settles_intents_without_an_alert() -> None:
    cluster = FakeCluster(["chat-b"], spec=COOLDOWN, history=[intent("chat-a")])
    remediator = Remediator(cluster, clock=Clock())

    asyncio.run(remediator.resume([(NS, SERVER)]))
    assert history(cluster) == [("chat-a", "evict", "evicted")]
    asyncio.run(remediator.resume([(NS, SERVER)]))  # once per server and process
    assert len(cluster.history) == 1


def test_a_deferral_recorded_before_a_restart_is_not_recorded_again() -> None:
    cluster = FakeCluster(["chat-a", "chat-b", "chat-c"], spec=COOLDOWN)
    deliver(Remediator(cluster, clock=Clock()), alert_json("chat-a"), alert_json("chat-b"))
    assert history(cluster) == [("chat-a", "evict", "evicted"), ("chat-b", "skip", "skipped")]

    restarted = Remediator(cluster, clock=Clock())
    assert deliver(restarted, alert_json("chat-b")) == [("chat-b", "skip", "cooldown")]
    assert history(cluster) == [("chat-a", "evict", "evicted"), ("chat-b", "skip", "skipped")]


def test_a_refusal_seen_again_leaves_no_intent() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"], spec=COOLDOWN, is_pdb_blocking=True)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    deliver(remediator, alert_json("chat-a"))
    clock.advance(15)
    asyncio.run(remediator.retry_due())
    assert cluster.eviction_attempts == ["chat-a", "chat-a"]
    assert history(cluster) == [("chat-a", "evict", "pdb-blocked")]
