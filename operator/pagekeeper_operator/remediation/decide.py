"""Which pods to evict for a batch of alerts (pure: data in, decisions out).

The checks run in a fixed order and the first that applies decides: resolved (or a late
firing of an episode already seen resolved, delivered out of order); no alertname, namespace or
pod label; duplicate delivery; unknown pod; not owned by an LLMServer; not one of
our alerts; remediation disabled; its trigger disabled; pod already going away; hysteresis;
cooldown; maxUnavailable; dry-run; else evict. Decisions within one batch see each other:
after one eviction the server is in cooldown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from pagekeeper_operator.alerts.triggers import is_active
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import TRIGGER_BY_ALERT, Runtime
from pagekeeper_operator.remediation.payload import WebhookAlert

ServerKey = tuple[str, str]
"""(namespace, LLMServer name)."""
PodKey = tuple[str, str]
"""(namespace, pod name)."""
AlertKey = tuple[str, datetime]  # (fingerprint, startsAt to the second)
"""(fingerprint, startsAt): one firing episode of one alert."""


class Verdict(StrEnum):
    EVICT = "evict"
    DRY_RUN = "dry-run"
    SKIP = "skip"


class SkipReason(StrEnum):
    RESOLVED = "resolved"
    UNKNOWN_ALERT = "unknown-alert"
    DUPLICATE = "duplicate"
    UNKNOWN_POD = "unknown-pod"
    NOT_OWNED = "not-owned"
    DISABLED = "remediation-disabled"
    TRIGGER_DISABLED = "trigger-disabled"
    POD_GOING_AWAY = "pod-going-away"
    HYSTERESIS = "hysteresis"
    COOLDOWN = "cooldown"
    MAX_UNAVAILABLE = "max-unavailable"


# Skips that may turn into an eviction later while the alert keeps firing.
RETRYABLE_REASONS = frozenset(
    {SkipReason.HYSTERESIS, SkipReason.COOLDOWN, SkipReason.MAX_UNAVAILABLE}
)


@dataclass(frozen=True)
class PodState:
    """A pod as the decision needs it; `server` is its LLMServer, None when it has none."""

    name: str
    namespace: str
    server: str | None
    is_ready: bool
    is_terminating: bool


@dataclass(frozen=True)
class ServerState:
    """An LLMServer and its pods."""

    namespace: str
    name: str
    remediation: RemediationSpec
    num_desired: int
    pods: tuple[PodState, ...]
    runtime: Runtime
    has_plugin: bool = True  # under vllm: pagekeeper's plugin loads (LLMServerSpec.has_vllm_plugin)


@dataclass(frozen=True)
class Memory:
    """What the operator already did: the part of the state that is not in the cluster."""

    acted_keys: frozenset[AlertKey] = frozenset()
    last_action_at: Mapping[ServerKey, datetime] = field(default_factory=dict)
    evicting: Mapping[ServerKey, frozenset[str]] = field(default_factory=dict)
    resolved_keys: frozenset[AlertKey] = frozenset()  # episodes seen resolved


@dataclass(frozen=True)
class Snapshot:
    """The cluster as seen for one batch: the pods the alerts name and their servers."""

    pods: Mapping[PodKey, PodState]
    servers: Mapping[ServerKey, ServerState]
    memory: Memory = field(default_factory=Memory)


@dataclass(frozen=True)
class Decision:
    """What to do about one alert."""

    verdict: Verdict
    alert: str
    key: AlertKey
    namespace: str
    pod: str
    server: str | None
    reason: SkipReason | None
    message: str

    @property
    def is_retryable(self) -> bool:
        return self.reason in RETRYABLE_REASONS


def trigger_enabled(server: ServerState, alert: str) -> bool | None:
    """Whether the trigger behind `alert` is active for `server`; None for an alert not ours."""
    trigger = TRIGGER_BY_ALERT.get(alert)
    if trigger is None:
        return None
    return is_active(server.runtime, server.remediation, trigger, has_plugin=server.has_plugin)


def num_unavailable(server: ServerState, evicting: frozenset[str]) -> int:
    """Pods not serving: not ready, terminating, being evicted, or not yet created."""
    down = {p.name for p in server.pods if p.is_terminating or not p.is_ready} | evicting
    num_ready = sum(1 for p in server.pods if p.name not in down)
    return max(len(down), server.num_desired - num_ready)


def _sort_key(alert: WebhookAlert) -> tuple[datetime, str]:
    return (alert.starts_at, alert.fingerprint)


@dataclass
class _Working:
    """Memory as it evolves within one batch."""

    acted: set[AlertKey]
    last_action_at: dict[ServerKey, datetime]
    evicting: dict[ServerKey, set[str]]
    resolved: frozenset[AlertKey] = frozenset()


def decide(alerts: Sequence[WebhookAlert], snapshot: Snapshot, now: datetime) -> list[Decision]:
    """One decision per alert, oldest alert first (the longest-firing problem acts first)."""
    memory = snapshot.memory
    working = _Working(
        acted=set(memory.acted_keys),
        last_action_at=dict(memory.last_action_at),
        evicting={key: set(pods) for key, pods in memory.evicting.items()},
        # A resolved notification may overtake the firing one (Alertmanager retries a failed
        # post): the episode is over whichever arrived first.
        resolved=memory.resolved_keys | {a.key for a in alerts if a.status == "resolved"},
    )
    decisions = []
    for alert in sorted(alerts, key=_sort_key):
        decision = _decide_one(alert, snapshot, working, now)
        if decision.verdict is not Verdict.SKIP:
            assert decision.server is not None, "an action always has a server"
            server_key = (decision.namespace, decision.server)
            working.acted.add(decision.key)
            working.last_action_at[server_key] = now
            if decision.verdict is Verdict.EVICT:
                working.evicting.setdefault(server_key, set()).add(decision.pod)
        decisions.append(decision)
    return decisions


def _decide_one(
    alert: WebhookAlert, snapshot: Snapshot, working: _Working, now: datetime
) -> Decision:
    namespace = alert.labels.get("namespace", "")
    pod_name = alert.labels.get("pod", "")
    base = Decision(
        verdict=Verdict.SKIP,
        alert=alert.name,
        key=alert.key,
        namespace=namespace,
        pod=pod_name,
        server=None,
        reason=None,
        message="",
    )

    def skip(reason: SkipReason, message: str, server: str | None = None) -> Decision:
        return dataclasses.replace(base, reason=reason, message=message, server=server)

    if alert.status == "resolved":
        return skip(SkipReason.RESOLVED, "the alert is resolved")
    if alert.key in working.resolved:
        return skip(SkipReason.RESOLVED, "this firing was already seen resolved (a late delivery)")
    if not namespace or not pod_name or not alert.name:
        return skip(SkipReason.UNKNOWN_ALERT, "the alert has no alertname, namespace or pod label")
    if alert.key in working.acted:
        return skip(SkipReason.DUPLICATE, "this firing was already acted on")
    pod = snapshot.pods.get((namespace, pod_name))
    if pod is None:
        return skip(SkipReason.UNKNOWN_POD, f"no pod {namespace}/{pod_name}")
    server = snapshot.servers.get((namespace, pod.server)) if pod.server else None
    if server is None:
        return skip(SkipReason.NOT_OWNED, f"pod {namespace}/{pod_name} has no LLMServer")
    name = server.name
    spec = server.remediation
    is_trigger_enabled = trigger_enabled(server, alert.name)
    if is_trigger_enabled is None:
        return skip(SkipReason.UNKNOWN_ALERT, f"{alert.name} is not a pagekeeper alert", name)
    if not spec.enabled:
        return skip(SkipReason.DISABLED, "spec.remediation.enabled is false", name)
    if not is_trigger_enabled:
        return skip(SkipReason.TRIGGER_DISABLED, f"the trigger of {alert.name} is not active", name)
    evicting = frozenset(working.evicting.get((namespace, name), set()))
    if pod.is_terminating or pod.name in evicting:
        return skip(SkipReason.POD_GOING_AWAY, "the pod is already going away", name)
    acts_at = alert.starts_at + timedelta(seconds=spec.hysteresis_seconds)
    if now < acts_at:
        return skip(SkipReason.HYSTERESIS, f"firing too briefly; acting from {acts_at}", name)
    last = working.last_action_at.get((namespace, name))
    if last is not None and now < last + timedelta(seconds=spec.cooldown_seconds):
        until = last + timedelta(seconds=spec.cooldown_seconds)
        return skip(SkipReason.COOLDOWN, f"cooldown until {until}", name)
    num_down = num_unavailable(server, evicting)
    # Evicting a pod that is already not ready does not make the server any less available.
    if num_down + (1 if pod.is_ready else 0) > spec.max_unavailable:
        message = (
            f"{num_down} of {server.num_desired} pods unavailable; "
            f"maxUnavailable is {spec.max_unavailable}"
        )
        return skip(SkipReason.MAX_UNAVAILABLE, message, name)
    if spec.dry_run:
        message = f"dry run: would evict {namespace}/{pod_name} for {alert.name}"
        return dataclasses.replace(base, verdict=Verdict.DRY_RUN, server=name, message=message)
    message = f"evicting {namespace}/{pod_name} for {alert.name}"
    return dataclasses.replace(base, verdict=Verdict.EVICT, server=name, message=message)
