"""Status from observation (pure): conditions, replica counts, the effective policy and the
active alert triggers.

The operator owns every status field except `remediationHistory`, `lastRemediation` and
`lastOutOfMemory`, which remediation writes and this module carries over unchanged.

MemoryHealthy follows `lastOutOfMemory` (set by the response to an out-of-memory termination,
which also sets the condition False with the classified reason):
- no out-of-memory termination recorded: True, NoMemoryEvents;
- the last one less than `spec.remediation.memoryHealthyAfterSeconds` ago: False, keeping the
  reason remediation gave (OutOfMemory if the condition was lost in a concurrent write);
- the last one at least that long ago: True again, NoRecentMemoryEvents. The resync re-plans
  every server periodically, so the condition recovers within one resync of the deadline.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from pagekeeper_operator.alerts.triggers import trigger_status
from pagekeeper_operator.api.autoscaling import AutoscalingStatus
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.status import Condition, ConditionStatus, LLMServerStatus
from pagekeeper_operator.api.tuning import TuningStatus
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.effective import EffectivePolicy, memory_policy_hash
from pagekeeper_operator.policy.fit import POLICY_FITS, FitOutcome
from pagekeeper_operator.policy.vllm_compat import plugin_verdict, policy_verdict
from pagekeeper_operator.render.meta import CONTAINER_NAME, selector_string
from pagekeeper_operator.status.api_key import API_KEY_AVAILABLE, ApiKeyCheck
from pagekeeper_operator.status.progress import progress_conditions
from pagekeeper_operator.timestamps import format_time, parse_time

MEMORY_HEALTHY = "MemoryHealthy"
NO_EVENTS_MESSAGE = "no out-of-memory events recorded"


def _deployment_condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    conditions: list[Mapping[str, Any]] = deployment.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def desired_replicas(server: LLMServer, deployment: Mapping[str, Any] | None) -> int:
    """The pods the server should have now: spec.replicas; the Deployment's own count under
    spec.autoscaling (the autoscaler's) and while a canary is analyzed (the canary pods are
    counted by the CanaryFailed condition and status.canary)."""
    num_desired = server.spec.replicas
    canary = server.status.canary
    is_analyzing = canary is not None and canary.phase == "Analyzing"
    if deployment is not None and (is_analyzing or server.spec.is_autoscaled):
        num_desired = int((deployment.get("spec") or {}).get("replicas", num_desired))
    return num_desired


def _judge(
    server: LLMServer, deployment: Mapping[str, Any] | None, apply_error: str | None
) -> list[tuple[str, bool, str, str]]:
    """(type, is_true, reason, message) for Ready, Progressing and Degraded."""
    num_desired = desired_replicas(server, deployment)
    if deployment is None:
        reason = "ApplyFailed" if apply_error else "DeploymentMissing"
        message = apply_error or "the Deployment does not exist yet"
        return [
            ("Ready", False, reason, message),
            ("Progressing", True, reason, message),
            ("Degraded", apply_error is not None, reason, message),
        ]
    status = deployment.get("status", {})
    num_ready = int(status.get("readyReplicas") or 0)
    num_updated = int(status.get("updatedReplicas") or 0)
    num_total = int(status.get("replicas") or 0)
    is_observed = int(status.get("observedGeneration") or 0) >= int(
        deployment.get("metadata", {}).get("generation") or 0
    )
    progress = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    is_stuck = progress.get("reason") == "ProgressDeadlineExceeded"

    counts = f"{num_ready}/{num_desired} replicas ready"
    if num_desired == 0:
        ready = ("Ready", True, "ScaledToZero", "0 replicas desired")
    elif num_ready >= num_desired:
        ready = ("Ready", True, "AllReplicasReady", counts)
    else:
        ready = ("Ready", False, "ReplicasNotReady", counts)

    is_rolling = not is_observed or num_updated < num_desired or num_total > num_updated
    if is_stuck:
        progressing = (
            "Progressing",
            False,
            "ProgressDeadlineExceeded",
            str(progress.get("message", "")),
        )
    elif is_rolling:
        progressing = (
            "Progressing",
            True,
            "RollingOut",
            f"{num_updated}/{num_desired} replicas run the current pod template",
        )
    else:
        progressing = (
            "Progressing",
            False,
            "RolloutComplete",
            f"{num_updated}/{num_desired} replicas run the current pod template",
        )

    if apply_error is not None:
        degraded = ("Degraded", True, "ApplyFailed", apply_error)
    elif is_stuck:
        degraded = ("Degraded", True, "ProgressDeadlineExceeded", str(progress.get("message", "")))
    elif failure.get("status") == "True":
        degraded = (
            "Degraded",
            True,
            str(failure.get("reason") or "ReplicaFailure"),
            str(failure.get("message", "")),
        )
    else:
        degraded = ("Degraded", False, "AsExpected", "")
    return [ready, progressing, degraded]


def _condition(
    previous: Condition | None,
    type_: str,
    is_true: bool | ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> Condition:
    status: ConditionStatus = (
        is_true if isinstance(is_true, str) else "True" if is_true else "False"
    )
    # lastTransitionTime moves only when status flips, as the conditions convention requires.
    since = previous.last_transition_time if previous and previous.status == status else None
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since or parse_time(now),
        observed_generation=generation,
    )


def memory_condition(server: LLMServer, now: str) -> Condition:
    """MemoryHealthy as the rule in the module docstring says."""
    status = server.status
    previous = status.condition(MEMORY_HEALTHY)
    generation = server.metadata.generation
    last = status.last_out_of_memory
    if last is None and previous is not None and previous.status == "False":
        # Set by an operator that did not record lastOutOfMemory: the transition is the OOM.
        last = previous.last_transition_time
    current = parse_time(now)
    if last is None:
        return _condition(
            previous, MEMORY_HEALTHY, True, "NoMemoryEvents", NO_EVENTS_MESSAGE, generation, now
        )
    window = server.spec.remediation.memory_healthy_after_seconds
    if current < last + timedelta(seconds=window):
        if previous is not None and previous.status == "False":
            return previous
        message = f"out-of-memory termination at {format_time(last)}"
        return _condition(previous, MEMORY_HEALTHY, False, "OutOfMemory", message, generation, now)
    message = f"no out-of-memory termination for {window}s (the last at {format_time(last)})"
    return _condition(
        previous, MEMORY_HEALTHY, True, "NoRecentMemoryEvents", message, generation, now
    )


def canary_condition(server: LLMServer, now: str) -> list[Condition]:
    """CanaryFailed, while canaries are enabled: True from a failed canary until the template
    changes again (a new analysis), False otherwise."""
    if not server.spec.rollout.canary.enabled:
        return []
    record = server.status.canary
    previous = server.status.condition("CanaryFailed")
    generation = server.metadata.generation
    if record is not None and record.phase == "Failed":
        return [_condition(previous, "CanaryFailed", True, "CanaryFailed", record.message,
                           generation, now)]  # fmt: skip
    reason = "Analyzing" if record is not None and record.phase == "Analyzing" else "NoFailure"
    message = record.message if record is not None else "no canary has failed"
    return [_condition(previous, "CanaryFailed", False, reason, message, generation, now)]


def running_image(server: LLMServer, deployment: Mapping[str, Any] | None) -> str:
    """The engine container's image as the Deployment runs it, else spec.image ("" unknown)."""
    template = ((deployment or {}).get("spec") or {}).get("template") or {}
    for container in (template.get("spec") or {}).get("containers") or []:
        if container.get("name") == CONTAINER_NAME:
            return str(container.get("image") or "")
    return server.spec.image or ""


def runtime_conditions(
    server: LLMServer,
    deployment: Mapping[str, Any] | None,
    now: str,
    policy: MemoryPolicy | None = None,
) -> list[Condition]:
    """PolicyHonored and PluginLoaded under runtime vllm (`vllm_compat`), of the effective
    `policy` (composed here when not given); none otherwise."""
    if server.spec.runtime != "vllm":
        return []
    if policy is None:
        policy = effective.compose(server).policy
    image = running_image(server, deployment)
    has_kv_events = server.spec.gateway.kv_events.enabled
    verdicts = [
        policy_verdict(policy, image, has_kv_events=has_kv_events),
        plugin_verdict(server),
    ]
    generation = server.metadata.generation
    return [
        _condition(server.status.condition(t), t, status, reason, message, generation, now)
        for t, status, reason, message in verdicts
    ]


def fit_condition(server: LLMServer, fit: FitOutcome | None, now: str) -> list[Condition]:
    """PolicyFits from this reconcile's plan; the last one kept where none was made (a status
    refresh from a Deployment event)."""
    if fit is None:
        previous = server.status.condition(POLICY_FITS)
        return [] if previous is None else [previous]
    status, reason, message = fit.condition
    previous = server.status.condition(POLICY_FITS)
    generation = server.metadata.generation
    return [_condition(previous, POLICY_FITS, status, reason, message, generation, now)]


def api_key_condition(server: LLMServer, check: ApiKeyCheck | None, now: str) -> list[Condition]:
    """ApiKeyAvailable from this reconcile's read of the Secret; the last one kept where none
    was made (a status refresh), and none without spec.apiKey."""
    previous = server.status.condition(API_KEY_AVAILABLE)
    if server.spec.api_key is None:
        return []
    if check is None:
        return [] if previous is None else [previous]
    generation = server.metadata.generation
    return [
        _condition(
            previous, API_KEY_AVAILABLE, check.status, check.reason, check.message, generation, now
        )
    ]


def compute_status(
    server: LLMServer,
    deployment: Mapping[str, Any] | None,
    now: str,
    apply_error: str | None = None,
    autoscaling: AutoscalingStatus | None = None,
    fit: FitOutcome | None = None,
    api_key: ApiKeyCheck | None = None,
    composed: EffectivePolicy | None = None,
) -> LLMServerStatus:
    """The status to write, given the Deployment as observed (None when absent), under
    spec.autoscaling what its autoscaler did (`autoscaling.autoscaling_status`), the memory
    plan of this reconcile (`fit.decide_fit`; None keeps the last one), its read of the API
    key's Secret (`api_key.check_api_key`; None keeps the last one) and its composition of the
    effective policy (`effective.compose`; made here when not given)."""
    old = server.status
    generation = server.metadata.generation
    conditions = [
        _condition(old.condition(type_), type_, is_true, reason, message, generation, now)
        for type_, is_true, reason, message in _judge(server, deployment, apply_error)
    ]
    memory = memory_condition(server, now)
    canary = canary_condition(server, now)
    dep_status = (deployment or {}).get("status", {})
    if composed is None:
        composed = effective.compose(server)
    policy = composed.policy
    tuning = old.tuning
    if tuning is not None or composed.step_down is not None:
        tuning = (tuning or TuningStatus()).model_copy(update={"step_down": composed.step_down})
    others = [
        memory,
        *canary,
        *runtime_conditions(server, deployment, now, policy),
        *fit_condition(server, fit, now),
        *api_key_condition(server, api_key, now),
    ]
    # From all the others (Stalled reads Progressing, PolicyFits and ApiKeyAvailable), listed
    # after Degraded.
    num_desired = desired_replicas(server, deployment)
    progress = [
        _condition(old.condition(type_), type_, is_true, reason, message, generation, now)
        for type_, is_true, reason, message in progress_conditions(
            server, [*conditions, *others], deployment, apply_error, num_desired
        )
    ]
    conditions = [*conditions, *progress, *others]
    return old.model_copy(
        update={
            "observed_generation": generation,
            "conditions": conditions,
            "memory_plan": old.memory_plan if fit is None else fit.status,
            "replicas": int(dep_status.get("replicas") or 0),
            "ready_replicas": int(dep_status.get("readyReplicas") or 0),
            "updated_replicas": int(dep_status.get("updatedReplicas") or 0),
            "selector": selector_string(server),
            "desired_replicas": num_desired,
            "autoscaling": autoscaling,
            "effective_memory_policy": policy,
            "spec_memory_policy_hash": memory_policy_hash(server.spec.memory_policy),
            "policy_hash": memory_policy_hash(policy),
            "tuning": tuning,
            "triggers": trigger_status(
                server.spec.runtime,
                server.spec.remediation,
                has_plugin=server.spec.has_vllm_plugin,
            ),
        }
    )
