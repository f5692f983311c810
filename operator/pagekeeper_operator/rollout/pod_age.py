"""Which pod to replace for its age under spec.lifecycle.maxPodAge (pure: data in, decision out).

A pod is due at `created + maxPodAge * (1 - SPREAD * u)`, where `u` in [0, 1) is read from the
SHA-256 of its uid: a fixed point between 90% and 100% of the age that depends on nothing but
the pod, so pods a rollout created together fall due spread over a tenth of the age instead of
all at once, and every operator process (a restarted one, another replica) computes the same.

One decision a server and round, in this order, the first that applies deciding: no maximum age
(`OFF`); no pod due (`NONE_DUE`); else the pod due first waits (`WAIT`) while a canary is under
way, while the Deployment's rollout is not complete, within spec.remediation.cooldownSeconds of
the last eviction (an alert's or an age's: one disruption budget for the server), or while
replacing it would put more than spec.remediation.maxUnavailable pods down; else `REPLACE`. The
PodDisruptionBudget has the last word: the eviction goes through the Eviction API.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pagekeeper_operator.api.lifecycle import format_age

SPREAD = 0.1
"""The fraction of the age over which pods created together fall due."""
AGE_ALERT = "MaxPodAge"
"""The `alert` of an age replacement's remediation record and metric."""


class AgeVerdict(StrEnum):
    REPLACE = "replace"
    WAIT = "wait"
    NONE_DUE = "none-due"
    OFF = "off"


class HoldReason(StrEnum):
    CANARY = "canary"
    ROLLOUT = "rollout"
    COOLDOWN = "cooldown"
    MAX_UNAVAILABLE = "max-unavailable"


@dataclass(frozen=True)
class AgedPod:
    """A pod of the server as the decision needs it."""

    name: str
    uid: str
    created_at: datetime
    is_ready: bool
    is_terminating: bool
    is_canary: bool


@dataclass(frozen=True)
class ServerAges:
    """One server's pods and what bounds their replacement."""

    max_age: timedelta | None
    pods: tuple[AgedPod, ...]
    num_desired: int
    max_unavailable: int
    cooldown: timedelta
    last_action_at: datetime | None
    is_canary_running: bool
    is_rollout_complete: bool


@dataclass(frozen=True)
class AgeDecision:
    """What to do this round; `pod` is the one replaced or waiting (None otherwise)."""

    verdict: AgeVerdict
    pod: AgedPod | None
    due_at: datetime | None
    reason: HoldReason | None
    message: str
    oldest_created_at: datetime | None
    next_due_at: datetime | None


def spread_of(pod: AgedPod) -> float:
    """The pod's fixed fraction `u` in [0, 1), from its uid (its name where it has none)."""
    digest = hashlib.sha256((pod.uid or pod.name).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def due_at(pod: AgedPod, max_age: timedelta) -> datetime:
    """When `pod` is due for replacement (see the module docstring)."""
    return pod.created_at + max_age * (1.0 - SPREAD * spread_of(pod))


def num_down(ages: ServerAges) -> int:
    """Pods not serving: not ready, going away, or not yet created (`remediation.decide`'s
    count, over the pods that are not a canary's)."""
    pods = [p for p in ages.pods if not p.is_canary]
    num_ready = sum(1 for p in pods if p.is_ready and not p.is_terminating)
    num_not_serving = sum(1 for p in pods if p.is_terminating or not p.is_ready)
    return max(num_not_serving, ages.num_desired - num_ready)


def decide_age(ages: ServerAges, now: datetime) -> AgeDecision:
    """This round's decision for one server (see the module docstring)."""
    serving = [p for p in ages.pods if not p.is_canary and not p.is_terminating]
    oldest = min((p.created_at for p in serving), default=None)
    max_age = ages.max_age
    if max_age is None:
        return AgeDecision(AgeVerdict.OFF, None, None, None, "", oldest, None)
    by_due = sorted(serving, key=lambda p: (due_at(p, max_age), p.name))
    if not by_due or due_at(by_due[0], max_age) > now:
        next_due = due_at(by_due[0], max_age) if by_due else None
        message = (
            "no pod serves"
            if next_due is None
            else f"no pod is due before {next_due:%Y-%m-%dT%H:%M:%SZ}"
        )
        return AgeDecision(AgeVerdict.NONE_DUE, None, None, None, message, oldest, next_due)
    pod = by_due[0]
    due = due_at(pod, max_age)
    later = [due_at(p, max_age) for p in by_due[1:]]
    what = (
        f"{pod.name} is {format_age(now - pod.created_at)} old, due since "
        f"{due:%Y-%m-%dT%H:%M:%SZ} (maxPodAge {format_age(max_age)})"
    )

    def wait(reason: HoldReason, why: str) -> AgeDecision:
        message = f"{what}; waiting: {why}"
        return AgeDecision(AgeVerdict.WAIT, pod, due, reason, message, oldest, due)

    if ages.is_canary_running:
        return wait(HoldReason.CANARY, "a canary is under way")
    if not ages.is_rollout_complete:
        return wait(HoldReason.ROLLOUT, "the Deployment's rollout is not complete")
    last = ages.last_action_at
    if last is not None and now < last + ages.cooldown:
        until = last + ages.cooldown
        return wait(HoldReason.COOLDOWN, f"cooldown until {until:%Y-%m-%dT%H:%M:%SZ}")
    down = num_down(ages)
    # Replacing a pod that is not ready does not make the server any less available.
    if down + (1 if pod.is_ready else 0) > ages.max_unavailable:
        why = (
            f"{down} of {ages.num_desired} pods unavailable, maxUnavailable {ages.max_unavailable}"
        )
        return wait(HoldReason.MAX_UNAVAILABLE, why)
    message = what
    # What serves once it is gone: the oldest of the others, and the next of them due.
    oldest = min((p.created_at for p in by_due[1:]), default=None)
    return AgeDecision(
        AgeVerdict.REPLACE, pod, due, None, message, oldest, min(later, default=None)
    )


def is_rollout_complete(deployment: Mapping[str, Any] | None) -> bool:
    """Whether the Deployment has rolled out its template to every replica and they are all
    available (what `kubectl rollout status` waits for); an absent one has not."""
    if deployment is None:
        return False
    metadata, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    status = deployment.get("status") or {}
    replicas = int(spec.get("replicas", 1))
    return (
        int(status.get("observedGeneration") or 0) >= int(metadata.get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) == replicas
        and int(status.get("replicas") or 0) == replicas
        and int(status.get("availableReplicas") or 0) == replicas
    )
