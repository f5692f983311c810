"""The remediation loop against an in-memory cluster: PDB refusals, retries, restarts, records."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from typing import Any

from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.state import PENDING_TTL, RemediationStore
from tests.operator.remediation_fakes import T0, Clock, FakeCluster, alert_json, message_json

KV = "PagekeeperKVCacheSaturated"


def deliver(remediator: Remediator, *alerts: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    message = WebhookMessage.model_validate(message_json(*alerts))
    summary = asyncio.run(remediator.handle(message))
    return [(d["pod"], d["verdict"], d["reason"]) for d in summary["decisions"]]


def history(cluster: FakeCluster) -> list[tuple[str, str, str, str]]:
    return [(r.pod, r.alert, r.action, r.outcome) for r in cluster.history]


def test_pdb_refusal_is_retried_never_forced() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"], is_pdb_blocking=True)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)

    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "evict", None)]
    assert cluster.eviction_attempts == ["chat-a"]
    assert history(cluster) == [("chat-a", KV, "evict", "pdb-blocked")]
    assert cluster.events == [
        ("Warning", "EvictionBlocked", f"{KV}: a PodDisruptionBudget forbids it")
    ]
    # A refusal starts no cooldown and leaves the pod as it was.
    assert remediator.store.last_action_at == {}
    assert cluster.pods["chat-a"].is_ready

    clock.advance(15)
    asyncio.run(remediator.retry_due())
    assert cluster.eviction_attempts == ["chat-a", "chat-a"]
    assert len(cluster.history) == 1  # the same refusal is recorded once
    assert len(cluster.events) == 1

    cluster.is_pdb_blocking = False
    clock.advance(15)
    asyncio.run(remediator.retry_due())
    assert cluster.eviction_attempts == ["chat-a", "chat-a", "chat-a"]
    assert history(cluster) == [
        ("chat-a", KV, "evict", "pdb-blocked"),
        ("chat-a", KV, "evict", "evicted"),
    ]
    assert cluster.events[-1] == ("Normal", "PodEvicted", f"{KV}: evicted prod/chat-a")
    assert cluster.pods["chat-a"].is_terminating
    assert remediator.store.pending == {}
    assert remediator.store.last_action_at == {("prod", "chat"): clock.now}


def test_repeated_delivery_evicts_once_even_after_a_restart() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"])
    clock = Clock()
    first = Remediator(cluster, clock=clock)
    assert deliver(first, alert_json("chat-a")) == [("chat-a", "evict", None)]
    assert deliver(first, alert_json("chat-a")) == [("chat-a", "skip", "duplicate")]

    # A new operator process: its memory comes back from status.remediationHistory.
    clock.advance(60)
    restarted = Remediator(cluster, store=RemediationStore(), clock=clock)
    assert deliver(restarted, alert_json("chat-a"), alert_json("chat-b")) == [
        ("chat-a", "skip", "duplicate"),
        ("chat-b", "skip", "cooldown"),
    ]
    assert cluster.eviction_attempts == ["chat-a"]


def test_cooldown_skip_is_recorded_once_and_acted_on_when_it_ends() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"], spec={"cooldownSeconds": 300})
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    deliver(remediator, alert_json("chat-a"))
    cluster.replace_pod("chat-a", "chat-c")

    clock.advance(30)
    assert deliver(remediator, alert_json("chat-b")) == [("chat-b", "skip", "cooldown")]
    clock.advance(30)
    assert deliver(remediator, alert_json("chat-b")) == [("chat-b", "skip", "cooldown")]
    assert history(cluster) == [
        ("chat-a", KV, "evict", "evicted"),
        ("chat-b", KV, "skip", "skipped"),
    ]
    assert cluster.history[1].message.startswith(f"{KV}: cooldown: cooldown until ")

    clock.advance(240)  # 300 s after the eviction
    [decision] = asyncio.run(remediator.retry_due())
    assert (decision.pod, decision.verdict) == ("chat-b", "evict")
    assert cluster.eviction_attempts == ["chat-a", "chat-b"]
    # The first pod is gone and replaced, so it no longer counts as being evicted.
    assert remediator.store.evicting == {("prod", "chat"): {"chat-b": clock.now}}


def test_resolved_delivery_cancels_a_deferred_alert() -> None:
    cluster = FakeCluster(["chat-a"], spec={"hysteresisSeconds": 600})
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "skip", "hysteresis")]
    assert list(remediator.store.pending) == ["chat-a-Pagekeepe"]
    assert deliver(remediator, alert_json("chat-a", status="resolved")) == [
        ("chat-a", "skip", "resolved")
    ]
    assert deliver(remediator, alert_json("chat-a", status="resolved")) == [
        ("chat-a", "skip", "resolved")
    ]
    clock.advance(600)
    assert asyncio.run(remediator.retry_due()) == []
    assert cluster.eviction_attempts == []
    assert cluster.history == []


def test_deferred_alerts_expire_without_redelivery() -> None:
    cluster = FakeCluster(["chat-a"], spec={"hysteresisSeconds": 60})
    clock = Clock(T0 - timedelta(minutes=5))
    remediator = Remediator(cluster, clock=clock)
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "skip", "hysteresis")]
    clock.advance(PENDING_TTL.total_seconds() + 1)
    assert asyncio.run(remediator.retry_due()) == []
    assert cluster.eviction_attempts == []


def test_dry_run_records_and_evicts_nothing() -> None:
    cluster = FakeCluster(["chat-a"], spec={"dryRun": True})
    remediator = Remediator(cluster, clock=Clock())
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "dry-run", None)]
    assert cluster.eviction_attempts == []
    assert history(cluster) == [("chat-a", KV, "dry-run", "would-evict")]
    assert cluster.events == [
        ("Normal", "RemediationDryRun", f"dry run: would evict prod/chat-a for {KV}")
    ]
    assert deliver(remediator, alert_json("chat-a")) == [("chat-a", "skip", "duplicate")]


def test_alerts_for_unknown_pods_touch_nothing() -> None:
    cluster = FakeCluster(["chat-a"])
    remediator = Remediator(cluster, clock=Clock())
    assert deliver(remediator, alert_json("chat-zzz")) == [("chat-zzz", "skip", "unknown-pod")]
    assert cluster.eviction_attempts == []
    assert cluster.history == []
    assert cluster.events == []
    assert remediator.store.pending == {}


def test_history_is_bounded_by_history_limit() -> None:
    cluster = FakeCluster(["chat-a"], spec={"historyLimit": 2, "cooldownSeconds": 0})
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    for index in range(3):
        clock.advance(60)
        cluster.replace_pod(cluster.pod_names[0], f"chat-{index}")
        deliver(remediator, alert_json(f"chat-{index}"))
    assert [r.pod for r in cluster.history] == ["chat-1", "chat-2"]


def test_retries_do_not_keep_an_alert_alive_that_alertmanager_stopped_sending() -> None:
    cluster = FakeCluster(["chat-a"], is_pdb_blocking=True)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    deliver(remediator, alert_json("chat-a"))
    num_rounds = int(PENDING_TTL.total_seconds() // 15) + 1
    for _ in range(num_rounds):
        clock.advance(15)
        asyncio.run(remediator.retry_due())
    assert len(cluster.eviction_attempts) == num_rounds  # the first plus the retries in TTL
    assert remediator.store.pending == {}
    # A fresh delivery of the still-firing alert starts retrying again.
    deliver(remediator, alert_json("chat-a"))
    assert len(cluster.eviction_attempts) == num_rounds + 1
    assert list(remediator.store.pending) == ["chat-a-Pagekeepe"]


def test_an_alert_that_fires_again_in_one_cooldown_is_recorded_once() -> None:
    spec = {"cooldownSeconds": 300, "hysteresisSeconds": 0}
    cluster = FakeCluster(["chat-a", "chat-b"], spec=spec)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    deliver(remediator, alert_json("chat-a"))
    cluster.replace_pod("chat-a", "chat-c")
    first_firing = clock.now - timedelta(seconds=10)

    clock.advance(30)
    assert deliver(remediator, alert_json("chat-b", starts_at=first_firing)) == [
        ("chat-b", "skip", "cooldown")
    ]
    clock.advance(5)
    resolved = alert_json("chat-b", status="resolved", starts_at=first_firing)
    assert deliver(remediator, resolved) == [("chat-b", "skip", "resolved")]
    clock.advance(5)  # the same series fires again: a new startsAt, the same cooldown
    assert deliver(remediator, alert_json("chat-b", starts_at=clock.now)) == [
        ("chat-b", "skip", "cooldown")
    ]
    assert history(cluster) == [
        ("chat-a", KV, "evict", "evicted"),
        ("chat-b", KV, "skip", "skipped"),
    ]
    assert [reason for _, reason, _ in cluster.events].count("RemediationDeferred") == 1

    clock.advance(260)  # the cooldown is over: the second firing is acted on
    [decision] = asyncio.run(remediator.retry_due())
    assert (decision.pod, decision.verdict) == ("chat-b", "evict")
    assert "chat-b-Pagekeepe" not in remediator.store.deferrals


def test_a_deferral_whose_detail_changes_while_it_is_retried_is_recorded_once() -> None:
    spec = {"cooldownSeconds": 0, "hysteresisSeconds": 0, "maxUnavailable": 1}
    cluster = FakeCluster(["chat-a", "chat-b", "chat-c"], spec=spec)
    cluster.pods["chat-a"] = replace(cluster.pods["chat-a"], is_ready=False)
    cluster.pods["chat-b"] = replace(cluster.pods["chat-b"], is_ready=False)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    assert deliver(remediator, alert_json("chat-c")) == [("chat-c", "skip", "max-unavailable")]
    cluster.pods["chat-b"] = replace(cluster.pods["chat-b"], is_ready=True)  # 1 down, not 2
    clock.advance(30)
    [decision] = asyncio.run(remediator.retry_due())
    assert (decision.pod, decision.verdict) == ("chat-c", "skip")
    assert "1 of 3 pods unavailable" in decision.message
    assert history(cluster) == [("chat-c", KV, "skip", "skipped")]
    assert "2 of 3 pods unavailable" in cluster.history[0].message
