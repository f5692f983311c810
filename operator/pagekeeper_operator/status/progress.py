"""Reconciling and Stalled (pure): the two conditions GitOps tools read, per kstatus.

kstatus (`sigs.k8s.io/cli-utils/pkg/kstatus`, what Flux's health checks run) reads an object as
InProgress while `status.observedGeneration` lags `metadata.generation` or `Reconciling` is
True, Failed while `Stalled` is True, and otherwise follows `Ready`. Argo CD's health script
(`charts/pagekeeper/argocd/health.lua`) reads the same conditions. At most one of the two is
True, because kstatus checks Reconciling first and a stalled server must read Failed:

| Stalled reason           | when                                                          |
|--------------------------|---------------------------------------------------------------|
| ApplyFailed              | the API server refused a child object (`refusal`)             |
| SecretMissing            | spec.apiKey's Secret, or its key, does not exist (`api_key`)  |
| PolicyDoesNotFit         | a PolicyFits condition is False: the memory plan does not fit  |
| ProgressDeadlineExceeded | the Deployment's rollout passed spec.progressDeadlineSeconds   |
| CanaryRolledBack         | the canary failed and was taken back; a new template is needed |
| Unreadable               | the stored object does not validate (a time stamp that does not |
|                          | parse, from before the CRD said `format: date-time`): the fields |
|                          | are named; nothing is done until they are corrected             |

| Reconciling reason | when (and nothing stalls)                                         |
|--------------------|-------------------------------------------------------------------|
| Retrying           | a write failed for a reason a retry can pass (a conflict, a 5xx)  |
| Creating           | the Deployment does not exist yet                                 |
| CanaryAnalyzing    | a canary of the new pod template is being analyzed                |
| RollingOut         | pods of an older template remain (a spec change or a step-down),  |
|                    | or the Deployment's rollout waits for new pods to become ready    |
| Draining           | more pods exist than are desired: the surplus is terminating      |

Otherwise both are False (reasons AsExpected and Idle) and Ready says whether the server serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.status import Condition
from pagekeeper_operator.status.api_key import API_KEY_AVAILABLE, SECRET_MISSING
from pagekeeper_operator.status.refusal import is_refused
from pagekeeper_operator.timestamps import parse_or

RECONCILING = "Reconciling"
STALLED = "Stalled"
POLICY_FITS = "PolicyFits"
UNREADABLE = "Unreadable"


def _find(conditions: Sequence[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def stalled_cause(
    server: LLMServer, conditions: Sequence[Condition], apply_error: str | None
) -> tuple[str, str] | None:
    """(reason, message) of what keeps the server from progressing without a change; None when
    nothing does. `conditions` are the ones being written (Ready, Progressing, Degraded, ...)."""
    if is_refused(apply_error):
        assert apply_error is not None
        return "ApplyFailed", apply_error
    api_key = _find(conditions, API_KEY_AVAILABLE)
    if api_key is not None and api_key.status == "False":
        return SECRET_MISSING, api_key.message
    fits = _find(conditions, POLICY_FITS) or server.status.condition(POLICY_FITS)
    if fits is not None and fits.status == "False":
        return "PolicyDoesNotFit", fits.message or "the memory plan does not fit the GPU"
    progressing = _find(conditions, "Progressing")
    if progressing is not None and progressing.reason == "ProgressDeadlineExceeded":
        detail = progressing.message or "the rollout made no progress in time"
        return "ProgressDeadlineExceeded", detail
    canary = server.status.canary
    if canary is not None and canary.phase == "Failed":
        message = "the canary failed and was rolled back; change the pod template to try again"
        return "CanaryRolledBack", f"{message}: {canary.message}" if canary.message else message
    return None


def reconciling_cause(
    server: LLMServer,
    conditions: Sequence[Condition],
    deployment: Mapping[str, Any] | None,
    apply_error: str | None,
    num_desired: int,
) -> tuple[str, str] | None:
    """(reason, message) of the work under way that needs no change to finish; None at rest.
    An `apply_error` that is no refusal (a conflict, the API server unavailable) is retried."""
    if apply_error is not None:
        return "Retrying", apply_error
    if deployment is None:
        return "Creating", "the Deployment does not exist yet"
    canary = server.status.canary
    if canary is not None and canary.phase == "Analyzing":
        return "CanaryAnalyzing", canary.message or "the canary of the new pod template is analyzed"
    progressing = _find(conditions, "Progressing")
    if progressing is not None and progressing.status == "True":
        return "RollingOut", progressing.message
    # Every pod runs the new template but not all are available yet: the Deployment's rollout
    # goes on until they are, or until its progress deadline stalls it.
    status = deployment.get("status") or {}
    conditions_seen: list[Mapping[str, Any]] = status.get("conditions") or []
    rollout = next((c for c in conditions_seen if c.get("type") == "Progressing"), {})
    if rollout.get("status") == "True" and rollout.get("reason") != "NewReplicaSetAvailable":
        num_ready = int(status.get("readyReplicas") or 0)
        return "RollingOut", f"{num_ready}/{num_desired} replicas ready; the rollout goes on"
    num_total = int(status.get("replicas") or 0)
    if num_total > num_desired:
        return "Draining", f"{num_total - num_desired} surplus pods are terminating"
    return None


def progress_conditions(
    server: LLMServer,
    conditions: Sequence[Condition],
    deployment: Mapping[str, Any] | None,
    apply_error: str | None,
    num_desired: int,
) -> list[tuple[str, bool, str, str]]:
    """(type, is_true, reason, message) for Reconciling and Stalled, as the table above says."""
    stalled = stalled_cause(server, conditions, apply_error)
    if stalled is not None:
        return [
            (RECONCILING, False, "Stalled", "no progress is possible until the spec changes"),
            (STALLED, True, *stalled),
        ]
    reconciling = reconciling_cause(server, conditions, deployment, apply_error, num_desired)
    if reconciling is not None:
        return [(RECONCILING, True, *reconciling), (STALLED, False, "AsExpected", "")]
    return [
        (RECONCILING, False, "Idle", "nothing is under way"),
        (STALLED, False, "AsExpected", ""),
    ]


def unreadable_conditions(
    conditions: Sequence[Mapping[str, Any]], message: str, now: str
) -> list[dict[str, Any]]:
    """The stored conditions (raw, since the object did not validate; any whose own time does
    not parse are dropped) with Stalled True for reason Unreadable and Reconciling False."""
    kept = [
        dict(c)
        for c in conditions
        if c.get("type") not in (RECONCILING, STALLED)
        and parse_or(c.get("lastTransitionTime"), None) is not None
    ]
    previous = {c.get("type"): c for c in conditions}

    def since(type_: str, status: str) -> str:
        old = previous.get(type_) or {}
        keep = old.get("status") == status and parse_or(old.get("lastTransitionTime"), None)
        return str(old["lastTransitionTime"]) if keep else now

    return [
        *kept,
        {"type": RECONCILING, "status": "False", "reason": STALLED,
         "message": "no progress is possible until the named fields are corrected",
         "lastTransitionTime": since(RECONCILING, "False")},
        {"type": STALLED, "status": "True", "reason": UNREADABLE, "message": message[:32768],
         "lastTransitionTime": since(STALLED, "True")},
    ]  # fmt: skip


def unreadable_status(
    body: Mapping[str, Any], error: ValidationError, now: str
) -> tuple[str, list[dict[str, Any]]]:
    """For a stored LLMServer its models refuse: the message naming each refused field by its
    path (`status.canary.startedAt: ...`) and the conditions that say it."""
    fields = "; ".join(
        f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()[:8]
    )
    message = f"the stored LLMServer does not validate: {fields}"
    conditions = (body.get("status") or {}).get("conditions") or []
    return message, unreadable_conditions(conditions, message, now)
