"""Remediation under a flood and a failing API: a firing delivered after its resolution, and a
history write the API refuses after the eviction (against the in-memory cluster)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.decide import Snapshot, decide
from pagekeeper_operator.remediation.payload import WebhookAlert, WebhookMessage
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.state import RESOLVED_TTL, RemediationStore, is_intent
from tests.operator.remediation_fakes import T0, Clock, FakeCluster, alert_json, message_json

KV = "PagekeeperKVCacheSaturated"


def deliver(remediator: Remediator, *alerts: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    message = WebhookMessage.model_validate(message_json(*alerts))
    summary = asyncio.run(remediator.handle(message))
    return [(d["pod"], d["verdict"], d["reason"]) for d in summary["decisions"]]


class FlakyStatusCluster(FakeCluster):
    """Status writes fail (`failures` of them, with `error`) before they pass again; with
    `spare_intents`, an eviction's intent (written before the eviction) is always taken."""

    failures: int = 0
    error: BaseException = RuntimeError("status of prod/chat kept changing; not written")
    spare_intents: bool = True

    async def append_history(
        self, namespace: str, server: str, record: RemediationRecord, limit: int
    ) -> None:
        if self.failures > 0 and not (self.spare_intents and is_intent(record)):
            self.failures -= 1
            raise self.error
        await super().append_history(namespace, server, record, limit)


def outcomes(cluster: FakeCluster) -> list[tuple[str, str, str]]:
    return [(r.pod, r.action, r.outcome) for r in cluster.history]


def test_a_firing_delivered_after_its_resolution_is_not_acted_on() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"])
    remediator = Remediator(cluster, clock=Clock())
    assert deliver(remediator, alert_json("chat-a", status="resolved")) == [
        ("chat-a", "skip", "resolved")
    ]
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "skip", "resolved")]
    assert cluster.eviction_attempts == [] and cluster.history == []
    # a new episode of the same series (a new startsAt) is a new firing
    again = alert_json("chat-a", starts_at=T0 - timedelta(minutes=1))
    assert deliver(remediator, again) == [("chat-a", "evict", None)]


def test_a_resolution_in_the_same_batch_wins_over_the_firing() -> None:
    firing = WebhookAlert.model_validate(alert_json("chat-a"))
    resolved = WebhookAlert.model_validate(alert_json("chat-a", status="resolved"))
    decisions = decide([firing, resolved], Snapshot(pods={}, servers={}), T0)
    assert [(d.reason, d.message) for d in decisions] == [
        ("resolved", "this firing was already seen resolved (a late delivery)"),
        ("resolved", "the alert is resolved"),
    ]


def test_resolved_firings_are_forgotten_after_their_ttl() -> None:
    store = RemediationStore()
    store.resolved(("old", "t"), T0)
    store.resolved(("new", "t"), T0 + RESOLVED_TTL + timedelta(seconds=1))
    assert store.memory().resolved_keys == frozenset({("new", "t")})


def test_an_eviction_whose_record_the_api_refused_is_recorded_later_not_lost() -> None:
    cluster = FlakyStatusCluster(["chat-a", "chat-b"])
    cluster.failures = 2
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "evict", None)]
    # the intent went in before the eviction; its outcome waits in the operator
    assert cluster.eviction_attempts == ["chat-a"]
    assert outcomes(cluster) == [("chat-a", "evict", "evicting")]
    assert len(remediator.store.unwritten) == 1
    # Alertmanager's repeat: nothing evicted twice; the write fails once more and waits.
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "skip", "duplicate")]
    assert outcomes(cluster) == [("chat-a", "evict", "evicting")]
    assert len(remediator.store.unwritten) == 1
    clock.advance(15)
    asyncio.run(remediator.retry_due())
    assert outcomes(cluster) == [("chat-a", "evict", "evicted")]  # the outcome replaced it
    assert remediator.store.unwritten == []
    # A restarted operator rebuilds its cooldown from that record: no second eviction.
    clock.advance(60)
    restarted = Remediator(cluster, store=RemediationStore(), clock=clock)
    assert deliver(restarted, alert_json("chat-b")) == [("chat-b", "skip", "cooldown")]
    assert cluster.eviction_attempts == ["chat-a"]


def test_a_permanent_refusal_of_a_record_is_not_kept() -> None:
    cluster = FlakyStatusCluster(["chat-a", "chat-b"])
    cluster.failures, cluster.error = 1, ApiException(status=403, reason="Forbidden")
    remediator = Remediator(cluster, clock=Clock())
    with pytest.raises(ApiException):
        deliver(remediator, alert_json("chat-a"))
    assert remediator.store.unwritten == []


def test_no_eviction_without_its_intent_on_record() -> None:
    # The intent's write fails: nothing is evicted, and the delivery fails (Alertmanager
    # retries it), whether the failure may pass or never can.
    for error in (RuntimeError("conflicts"), ApiException(status=403, reason="Forbidden")):
        cluster = FlakyStatusCluster(["chat-a", "chat-b"])
        cluster.failures, cluster.error, cluster.spare_intents = 1, error, False
        remediator = Remediator(cluster, clock=Clock())
        with pytest.raises(type(error)):
            deliver(remediator, alert_json("chat-a"))
        assert cluster.eviction_attempts == [] and cluster.history == []
        # the retry, with the API back: evicted once, on record
        assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "evict", None)]
        assert outcomes(cluster) == [("chat-a", "evict", "evicted")]
