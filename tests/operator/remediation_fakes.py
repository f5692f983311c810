"""An in-memory cluster behind `ClusterPort`, and Alertmanager payloads, for remediation tests."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pagekeeper_operator.api.remediation import RemediationRecord, RemediationSpec
from pagekeeper_operator.remediation.decide import PodState, ServerState
from pagekeeper_operator.remediation.port import EventType, EvictionOutcome, ServerInfo
from pagekeeper_operator.remediation.state import is_intent

NS = "prod"
SERVER = "chat"
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@dataclass
class FakeCluster:
    """One LLMServer `chat` in `prod` with ready pods; a PodDisruptionBudget that may refuse.

    There is no way to delete a pod here: the port has none, so nothing can force one.
    """

    pod_names: list[str]
    spec: dict[str, Any] = field(default_factory=dict)
    is_pdb_blocking: bool = False
    pods: dict[str, PodState] = field(default_factory=dict)
    history: list[RemediationRecord] = field(default_factory=list)
    events: list[tuple[EventType, str, str]] = field(default_factory=list)
    eviction_attempts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in self.pod_names:
            self.pods[name] = PodState(name, NS, SERVER, is_ready=True, is_terminating=False)

    async def read_pod(self, namespace: str, name: str) -> PodState | None:
        return self.pods.get(name) if namespace == NS else None

    async def read_server(self, namespace: str, name: str) -> ServerInfo | None:
        if (namespace, name) != (NS, SERVER):
            return None
        state = ServerState(
            NS,
            SERVER,
            RemediationSpec.model_validate(self.spec),
            len(self.pod_names),
            tuple(self.pods.values()),
            "pagekeeper",
        )
        return ServerInfo(state, tuple(self.history))

    async def evict(self, namespace: str, pod: str) -> tuple[EvictionOutcome, str]:
        self.eviction_attempts.append(pod)
        if pod not in self.pods:
            return EvictionOutcome.POD_GONE, f"pod {namespace}/{pod} no longer exists"
        if self.is_pdb_blocking:
            return EvictionOutcome.PDB_BLOCKED, "a PodDisruptionBudget forbids it"
        self.pods[pod] = replace(self.pods[pod], is_ready=False, is_terminating=True)
        return EvictionOutcome.EVICTED, f"evicted {namespace}/{pod}"

    async def emit_event(
        self, namespace: str, server: str, type_: EventType, reason: str, message: str
    ) -> None:
        assert (namespace, server) == (NS, SERVER)
        self.events.append((type_, reason, message))

    async def append_history(
        self, namespace: str, server: str, record: RemediationRecord, limit: int
    ) -> None:
        assert (namespace, server) == (NS, SERVER)
        if any(self._is_intent_of(r, record) for r in self.history):
            self.history = [record if self._is_intent_of(r, record) else r for r in self.history]
        else:
            self.history = [*self.history, record][-limit:]

    async def drop_intent(self, namespace: str, server: str, record: RemediationRecord) -> None:
        assert (namespace, server) == (NS, SERVER)
        self.history = [r for r in self.history if not self._is_intent_of(r, record)]

    @staticmethod
    def _is_intent_of(entry: RemediationRecord, record: RemediationRecord) -> bool:
        same = (entry.pod, entry.fingerprint, entry.alert_starts_at)
        return is_intent(entry) and same == (record.pod, record.fingerprint, record.alert_starts_at)

    def replace_pod(self, old: str, new: str) -> None:
        """The Deployment's work: the evicted pod is gone and a new one is ready."""
        del self.pods[old]
        self.pod_names = [new if name == old else name for name in self.pod_names]
        self.pods[new] = PodState(new, NS, SERVER, is_ready=True, is_terminating=False)


class Clock:
    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def alert_json(
    pod: str,
    *,
    name: str = "PagekeeperKVCacheSaturated",
    status: str = "firing",
    starts_at: datetime = T0 - timedelta(minutes=5),
    fingerprint: str | None = None,
) -> dict[str, Any]:
    return {
        "status": status,
        "labels": {
            "alertname": name,
            "namespace": NS,
            "pod": pod,
            "llmserver": SERVER,
            "severity": "warning",
            "pagekeeper_remediate": "true",
        },
        "annotations": {"summary": f"KV cache nearly full on {NS}/{pod}"},
        "startsAt": starts_at.isoformat().replace("+00:00", "Z"),
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else T0.isoformat(),
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint or f"{pod}-{name}"[:16],
    }


def message_json(*alerts: dict[str, Any]) -> dict[str, Any]:
    is_firing = any(a["status"] == "firing" for a in alerts)
    return {
        "version": "4",
        "groupKey": '{}:{alertname="PagekeeperKVCacheSaturated"}',
        "truncatedAlerts": 0,
        "status": "firing" if is_firing else "resolved",
        "receiver": "pagekeeper",
        "groupLabels": {"alertname": "PagekeeperKVCacheSaturated"},
        "commonLabels": {"namespace": NS},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }
