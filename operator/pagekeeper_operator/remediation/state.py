"""What the operator has done, kept in memory and rebuilt from status after a restart.

The store is the mutable side of `decide.Memory`: alert firings already acted on (so repeated
deliveries do nothing), firings seen resolved (so a late firing of one does nothing), the last
action per server (cooldown), evictions still in progress (maxUnavailable), and firing alerts
that were deferred (hysteresis, cooldown, maxUnavailable, a PodDisruptionBudget) and are
retried while they keep firing. History records whose status write failed wait in `unwritten`
until a later batch or retry writes them: an eviction's record is what a restarted operator
rebuilds its cooldown and deduplication from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.decide import AlertKey, Memory, ServerKey
from pagekeeper_operator.remediation.payload import WebhookAlert

# A deferred alert not re-delivered for this long is dropped: Alertmanager re-sends firing
# alerts every repeat_interval and resolved ones when they resolve (see docs/runbook.md).
PENDING_TTL = timedelta(minutes=30)
# An eviction decided and not yet answered: written before the Eviction API is called, and
# replaced by the outcome (`actions.bounded_history`). One left by an operator that died in
# between is settled from the pod by the next one (`Remediator`).
EVICT_INTENT = "evicting"
# Records that count as an action for cooldown and deduplication.
ACTED_OUTCOMES = frozenset(
    {("evict", "evicted"), ("evict", EVICT_INTENT), ("dry-run", "would-evict")}
)
# A resolved firing is remembered this long against late deliveries of it.
RESOLVED_TTL = timedelta(hours=1)


def is_intent(record: RemediationRecord) -> bool:
    return record.action == "evict" and record.outcome == EVICT_INTENT


@dataclass(frozen=True)
class UnwrittenRecord:
    """A history record whose status write failed, for its server, with its history limit."""

    server: ServerKey
    record: RemediationRecord
    limit: int


@dataclass
class _Pending:
    alert: WebhookAlert
    seen_at: datetime


@dataclass
class RemediationStore:
    """In-memory remediation state; one per operator process."""

    acted_keys: set[AlertKey] = field(default_factory=set)
    last_action_at: dict[ServerKey, datetime] = field(default_factory=dict)
    # server -> pod -> when its eviction was accepted.
    evicting: dict[ServerKey, dict[str, datetime]] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)
    # (alert key, what) already written to status/Events, so a retried skip is recorded once.
    noted: set[tuple[AlertKey, str]] = field(default_factory=set)
    # alert fingerprint -> the last deferral written for that series: an alert that resolves
    # and fires again (a new startsAt) while deferred for the same reason until the same time
    # is recorded once. One entry a series, dropped when the series is acted on.
    deferrals: dict[str, str] = field(default_factory=dict)
    # alert key -> when it was seen resolved (dropped after RESOLVED_TTL).
    resolved_keys: dict[AlertKey, datetime] = field(default_factory=dict)
    unwritten: list[UnwrittenRecord] = field(default_factory=list)

    def memory(self) -> Memory:
        return Memory(
            acted_keys=frozenset(self.acted_keys),
            last_action_at=dict(self.last_action_at),
            evicting={key: frozenset(pods) for key, pods in self.evicting.items()},
            resolved_keys=frozenset(self.resolved_keys),
        )

    def resolved(self, key: AlertKey, now: datetime) -> None:
        """The firing `key` is over; later deliveries of it as firing are late."""
        self.resolved_keys[key] = now
        for old, seen_at in list(self.resolved_keys.items()):
            if now - seen_at > RESOLVED_TTL:
                del self.resolved_keys[old]

    def rebuild(self, server: ServerKey, history: Sequence[RemediationRecord]) -> None:
        """Merge cooldown and deduplication from a server's status history.

        Called on every read of the server, so a restarted operator (or another replica)
        keeps the cooldowns, does not act twice on one firing and does not record a deferral
        again that it recorded before.
        """
        for record in history:
            if record.action == "skip" and record.fingerprint:
                self.deferrals[record.fingerprint] = record.message
            if (record.action, record.outcome) not in ACTED_OUTCOMES:
                continue
            if record.fingerprint:
                self.deferrals.pop(record.fingerprint, None)
            when = record.time
            if server not in self.last_action_at or self.last_action_at[server] < when:
                self.last_action_at[server] = when
            if record.fingerprint and record.alert_starts_at:
                self.acted_keys.add((record.fingerprint, record.alert_starts_at))

    def acted(self, server: ServerKey, key: AlertKey, when: datetime) -> None:
        self.acted_keys.add(key)
        self.deferrals.pop(key[0], None)
        self.last_action_at[server] = max(when, self.last_action_at.get(server, when))

    def evicted(self, server: ServerKey, pod: str, key: AlertKey, when: datetime) -> None:
        self.acted(server, key, when)
        self.evicting.setdefault(server, {})[pod] = when

    def forget_gone(
        self, server: ServerKey, pod_names: Iterable[str], now: datetime, drain_timeout: timedelta
    ) -> list[str]:
        """Stop counting evictions whose pod is gone, or that outlived the drain timeout.

        Returns the pods that outlived it (still present: their eviction did not complete).
        """
        present = set(pod_names)
        stuck = []
        evicting = self.evicting.get(server, {})
        for pod, since in list(evicting.items()):
            if pod not in present:
                del evicting[pod]
            elif now - since > drain_timeout:
                del evicting[pod]
                stuck.append(pod)
        return stuck

    def defer(self, alert: WebhookAlert, now: datetime, is_delivery: bool) -> None:
        """Keep the alert for a retry; only a delivery from Alertmanager renews its TTL."""
        entry = self.pending.get(alert.fingerprint)
        if entry is None or is_delivery:
            self.pending[alert.fingerprint] = _Pending(alert, now)

    def settle(self, alert: WebhookAlert) -> None:
        """The alert needs no retry: it resolved, was acted on, or can never be acted on."""
        self.pending.pop(alert.fingerprint, None)
        self.noted = {noted for noted in self.noted if noted[0] != alert.key}

    def due(self, now: datetime) -> list[WebhookAlert]:
        """Deferred alerts to decide again; drops those not re-delivered within PENDING_TTL."""
        for fingerprint, entry in list(self.pending.items()):
            if now - entry.seen_at > PENDING_TTL:
                del self.pending[fingerprint]
        return [entry.alert for entry in self.pending.values()]

    def note_deferral(self, fingerprint: str, message: str) -> bool:
        """True when this alert series' deferral differs from the last one recorded for it (its
        reason and detail, e.g. the cooldown's end): record it; False for a repeat."""
        if self.deferrals.get(fingerprint) == message:
            return False
        self.deferrals[fingerprint] = message
        return True

    def note_once(self, key: AlertKey, what: str) -> bool:
        """True the first time (key, what) is seen: record it; False after that."""
        if (key, what) in self.noted:
            return False
        self.noted.add((key, what))
        return True
