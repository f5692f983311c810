"""The response to an out-of-memory or stuck termination (pure): status patch, history record,
Event.

The effective policy is stepped down in status (never spec), each side on its own: the GPU terms
for run-time GPU OOMs, the host KV tier for host OOMs (the kubelet's OOMKilled); every OOM
is classified into the MemoryHealthy condition (and `lastOutOfMemory`, from which the condition
recovers: see `conditions`) and recorded once in remediationHistory, identified by (pod uid,
container, finishedAt) so a restarted operator does not step twice. A stuck engine's termination
(`adaptive.StuckClassification`) is recorded the same way, as `stuck`, but touches neither the
policy nor MemoryHealthy: memory was not what failed. Nor does the OOM of a tuning trial's
canary pod step down: that pod ran the trial's change, which the canary's failure takes back.
After a step-down the handler reconciles the server at once, so the stepped-down policy rolls
the pods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.adaptive import (
    OOMClassification,
    Termination,
    classify_failure,
    step_down,
    step_down_host,
)
from pagekeeper_operator.policy.effective import memory_policy_hash
from pagekeeper_operator.remediation.actions import bounded_history
from pagekeeper_operator.remediation.port import EventType
from pagekeeper_operator.rollout.canary import CANARY_SUFFIX
from pagekeeper_operator.timestamps import format_time, parse_or

CONDITION_TYPE = "MemoryHealthy"
NO_HOST_TIER = (
    "no host KV tier to shrink (memoryPolicy.kvOffload unset) and the GPU terms are not the "
    "host's: raise the pod's memory limit, or lower swapSpaceGiB or cpuOffloadGb "
    "(docs/runbook.md, OOMKilled)"
)


@dataclass(frozen=True)
class OOMResponse:
    """What to write for one OOM termination."""

    status: dict[str, Any]
    record: RemediationRecord
    event_type: EventType
    event_reason: str


def termination_key(pod_uid: str, container: str, finished_at: str) -> str:
    """Identity of one termination (fits RemediationRecord.fingerprint)."""
    text = f"{pod_uid}/{container}/{finished_at}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def oom_terminations(pod: Mapping[str, Any]) -> list[tuple[str, Termination, str]]:
    """(container, classification, finishedAt) of each OOM or stuck termination a pod reports.

    A termination shows as `state.terminated` while the container is down and as
    `lastState.terminated` once it restarted; the same one is listed once.
    """
    found: dict[tuple[str, str], Termination] = {}
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state"), status.get("lastState")):
            terminated = (state or {}).get("terminated")
            if not terminated:
                continue
            classification = classify_failure(terminated.get("reason"), terminated.get("message"))
            if classification is not None:
                finished_at = str(terminated.get("finishedAt") or "")
                found.setdefault((str(status.get("name", "")), finished_at), classification)
    return [(container, c, finished_at) for (container, finished_at), c in found.items()]


def _conditions(
    conditions: Sequence[Mapping[str, Any]], reason: str, message: str, generation: int, now: str
) -> list[dict[str, Any]]:
    """`conditions` with MemoryHealthy set False (a map-list keyed by type: replace in place)."""
    previous = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
    since = now
    if previous is not None and previous.get("status") == "False":
        since = previous.get("lastTransitionTime", now)
    condition = {
        "type": CONDITION_TYPE,
        "status": "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }
    others = [dict(c) for c in conditions if c.get("type") != CONDITION_TYPE]
    return [*others, condition]


def respond_to_oom(
    body: Mapping[str, Any],
    pod: str,
    classification: Termination,
    key: str,
    finished_at: str,
    now: datetime,
) -> OOMResponse | None:
    """The status to write for an OOM of `pod` of the LLMServer `body`; None if recorded."""
    status = body.get("status") or {}
    history: list[dict[str, Any]] = status.get("remediationHistory") or []
    if any(entry.get("fingerprint") == key for entry in history):
        return None
    server = LLMServer.from_body(body)
    remediation = server.spec.remediation
    when = format_time(now)
    patch: dict[str, Any] = {}
    trial = server.status.tuning.trial if server.status.tuning is not None else None
    if not classification.is_memory:
        outcome = "not-applicable"
        message = "a stuck engine is restarted, never stepped down: memory was not what failed"
    elif trial is not None and pod.startswith(f"{server.metadata.name}{CANARY_SUFFIX}-"):
        # The canary runs the policy in force plus the trial's change: its OOM is evidence
        # against that change (the canary fails on it, so the trial is rolled back), not
        # against the policy the other pods run.
        outcome = "not-applicable"
        message = (
            f"a canary pod of the tuning trial {trial.field} {trial.current} -> "
            f"{trial.proposed} ran out of memory: the trial is rolled back, the policy the "
            "other pods run is not stepped down"
        )
    elif not classification.can_step_down:
        outcome = "not-applicable"
        message = (
            f"{classification.label}: a GPU OOM at start-up is not stepped down (the model does "
            "not fit the budget at all)"
        )
    elif not remediation.enabled or not remediation.adaptive.enabled:
        outcome, message = "disabled", "spec.remediation.adaptive is disabled"
    else:
        current = effective.compose(server).policy
        is_host = isinstance(classification, OOMClassification) and classification.device == "host"
        # Each side steps its own terms: a host OOM never lowers a GPU term, nor the reverse.
        step = (step_down_host if is_host else step_down)(current.to_api(), remediation.adaptive)
        if step is None and is_host:
            outcome, message = "not-applicable", NO_HOST_TIER
        elif step is None:
            outcome, message = "at-floor", "the effective policy is at its floors"
        else:
            policy, message = step
            try:
                lowered = MemoryPolicy.model_validate(policy)
            except ValidationError as error:
                outcome, message = "at-floor", f"the next step is not a valid policy: {error}"
            else:
                if remediation.dry_run:
                    outcome, message = "would-apply", f"dry run: {message}"
                else:
                    outcome = "applied"
                    patch["effectiveMemoryPolicy"] = lowered.to_api()
                    patch["specMemoryPolicyHash"] = memory_policy_hash(server.spec.memory_policy)
                    patch["lastRemediation"] = when
    detail = f": {classification.detail}" if classification.detail else ""
    record = RemediationRecord(
        time=now,
        pod=pod,
        alert=classification.label,
        action="step-down",
        outcome=outcome,
        message=f"{classification.condition_reason}{detail}; {message}"[:1024],
        fingerprint=key,
        alertStartsAt=parse_or(finished_at, None),
    )
    patch["remediationHistory"] = bounded_history(history, record, remediation.history_limit)
    event_type: EventType = "Normal" if outcome == "applied" else "Warning"
    reason = "PolicySteppedDown" if outcome == "applied" else classification.condition_reason
    if not classification.is_memory:
        return OOMResponse(patch, record, event_type, reason)
    patch["lastOutOfMemory"] = when
    patch["conditions"] = _conditions(
        status.get("conditions") or [],
        classification.condition_reason,
        f"pod {pod}{detail}"[:1024],
        server.metadata.generation,
        when,
    )
    return OOMResponse(patch, record, event_type, reason)
