"""Named points between the steps of the operator's multi-step actions, where a test kills it.

`PAGEKEEPER_FAULT_POINT=<point>[:<nth>]` makes the process SIGKILL itself the `nth` time (from
1, the default) it reaches `<point>`: no cleanup, no `finally`, no status written, as when its
node dies. The crash-consistency suite (`tests/crash/`, `docs/crash-consistency.md`) runs each
point, restarts the operator without it and checks that the action resumes from what the cluster
holds. Unset (production), `reached` is one comparison. A test hook: the environment is read
here, once, and not by `settings`.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

FAULT_POINT_ENV = "PAGEKEEPER_FAULT_POINT"


class FaultPoint(StrEnum):
    """Every kill point, in the order of the steps each action takes."""

    # Remediation: alert accepted -> intent in history -> eviction -> outcome in history -> Event.
    REMEDIATION_DECIDED = "remediation.decided"
    REMEDIATION_INTENT_RECORDED = "remediation.intent-recorded"
    REMEDIATION_EVICTED = "remediation.evicted"
    REMEDIATION_RECORDED = "remediation.recorded"
    REMEDIATION_EVENT_POSTED = "remediation.event-posted"
    REMEDIATION_DEFERRAL_RECORDED = "remediation.deferral-recorded"
    # The canary: start -> canary Deployment -> status; analysis -> promote or roll back ->
    # canary Deployment deleted -> status.
    CANARY_START_DECIDED = "canary.start-decided"
    CANARY_DEPLOYMENT_APPLIED = "canary.deployment-applied"
    CANARY_PROMOTION_DECIDED = "canary.promotion-decided"
    CANARY_PROMOTION_APPLIED = "canary.promotion-applied"
    CANARY_PROMOTION_PRUNED = "canary.promotion-pruned"
    CANARY_ROLLBACK_DECIDED = "canary.rollback-decided"
    CANARY_ROLLBACK_APPLIED = "canary.rollback-applied"
    CANARY_ROLLBACK_PRUNED = "canary.rollback-pruned"
    # Adaptive step-down: OOM classified -> history and effective policy in status -> Event ->
    # rollout of the lowered policy.
    STEPDOWN_CLASSIFIED = "stepdown.classified"
    STEPDOWN_RECORDED = "stepdown.recorded"
    STEPDOWN_EVENT_POSTED = "stepdown.event-posted"
    STEPDOWN_ROLLED_OUT = "stepdown.rolled-out"
    # Autoscaling: the count handed over -> the Deployment applied without it; deletion costs
    # planned -> each pod's cost written.
    AUTOSCALING_HANDED_OVER = "autoscaling.handed-over"
    AUTOSCALING_APPLIED = "autoscaling.applied"
    DELETION_COSTS_PLANNED = "autoscaling.deletion-costs-planned"
    DELETION_COST_WRITTEN = "autoscaling.deletion-cost-written"


# The canary's points by the Event of its step and how far the reconcile got with it: decided
# (nothing written), its Deployments applied (or already as rendered), the canary Deployment
# deleted (or already gone); status not written.
CanaryStage = Literal["decided", "applied", "pruned"]
CANARY_POINTS: dict[tuple[str, CanaryStage], FaultPoint] = {
    ("CanaryStarted", "decided"): FaultPoint.CANARY_START_DECIDED,
    ("CanaryStarted", "applied"): FaultPoint.CANARY_DEPLOYMENT_APPLIED,
    ("CanaryPromoted", "decided"): FaultPoint.CANARY_PROMOTION_DECIDED,
    ("CanaryPromoted", "applied"): FaultPoint.CANARY_PROMOTION_APPLIED,
    ("CanaryPromoted", "pruned"): FaultPoint.CANARY_PROMOTION_PRUNED,
    ("CanaryFailed", "decided"): FaultPoint.CANARY_ROLLBACK_DECIDED,
    ("CanaryFailed", "applied"): FaultPoint.CANARY_ROLLBACK_APPLIED,
    ("CanaryFailed", "pruned"): FaultPoint.CANARY_ROLLBACK_PRUNED,
}


class StepEvent(Protocol):
    """The Event a canary step posts (`canary.CanaryEvent`)."""

    @property
    def reason(self) -> str: ...


@dataclass
class ArmedPoint:
    """The point this process dies at, and how often it has been reached so far."""

    point: FaultPoint
    nth: int
    num_hits: int = 0


def parse_fault_point(text: str) -> ArmedPoint | None:
    """`<point>[:<nth>]` as an ArmedPoint; None for an empty text; ValueError naming the
    variable for an unknown point or a bad count."""
    text = text.strip()
    if not text:
        return None
    name, sep, count = text.partition(":")
    try:
        point = FaultPoint(name)
    except ValueError:
        raise ValueError(f"{FAULT_POINT_ENV}={text!r}: no fault point {name!r}") from None
    if sep and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"{FAULT_POINT_ENV}={text!r}: the count must be an integer >= 1")
    return ArmedPoint(point, int(count) if sep else 1)


_ARMED = parse_fault_point(os.environ.get(FAULT_POINT_ENV, ""))


def reached(point: FaultPoint) -> None:
    """The operator is at `point`: die here (SIGKILL) when the environment armed it."""
    armed = _ARMED
    if armed is None or armed.point is not point:
        return
    armed.num_hits += 1
    if armed.num_hits == armed.nth:
        # The one line the harness reads to know the kill came from here, not elsewhere.
        sys.stderr.write(f"pagekeeper fault point {point}:{armed.nth} reached: SIGKILL\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def reached_canary(event: StepEvent | None, stage: CanaryStage) -> None:
    """The reconcile is at `stage` of the canary step that posts `event` (None: no step)."""
    point = None if event is None else CANARY_POINTS.get((event.reason, stage))
    if point is not None:
        reached(point)
