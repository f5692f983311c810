"""Replicas under spec.autoscaling (pure): handing the count over to the autoscaler, and what
the autoscaler did, for status.

**No fight.** With spec.autoscaling the rendered Deployment has no `replicas`, so the operator's
server-side apply never owns it and the autoscaler's writes stand. A Deployment the operator
made before autoscaling was on still lists `replicas` under the operator's field manager; an
apply without it would delete the field and the API server would default it to 1, killing
pods. So once, before that apply, `handover` applies the current count under a second manager
(without force, so a concurrent change by the autoscaler wins): the field stays, owned by that
manager until the autoscaler's first write takes it. Turning autoscaling off again applies
spec.replicas with force, taking the field back.

**Status.** The HorizontalPodAutoscaler (ours, or the one KEDA makes for a ScaledObject) says
how many pods it wants and when it last changed the count; `scale_reason` names the signal that
asked for the most pods, with its per-pod value and target, or the bound that held.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pagekeeper_operator.api.autoscaling import AutoscalerKind, AutoscalingStatus
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.autoscaler import HPA_KIND, autoscaler_hpa_name, metric_keys
from pagekeeper_operator.timestamps import parse_or

HANDOVER_MANAGER = "pagekeeper-autoscaler-handover"
# The quantity suffixes the API server writes for metric values (status.currentMetrics).
_SUFFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


def owns_replicas(deployment: Mapping[str, Any], manager: str) -> bool:
    """Whether `manager` applied `spec.replicas` of the Deployment (its managedFields)."""
    for entry in deployment.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        if entry.get("subresource"):
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in spec:
            return True
    return False


def handover(
    server: LLMServer, deployment: Mapping[str, Any] | None, manager: str
) -> dict[str, Any] | None:
    """The apply that keeps the Deployment's count when `manager` stops applying it: the
    current `spec.replicas` under HANDOVER_MANAGER; None when nothing is to hand over."""
    if not server.spec.is_autoscaled or deployment is None:
        return None
    if not owns_replicas(deployment, manager):
        return None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": server.metadata.name, "namespace": server.metadata.namespace},
        "spec": {"replicas": int(deployment.get("spec", {}).get("replicas") or 0)},
    }


def metric_value(text: str | int | float) -> float:
    """A metric quantity as a number (`4`, `1500m`, `2k`); NaN when unreadable."""
    if isinstance(text, int | float):
        return float(text)
    digits = text.rstrip("numkMG")
    suffix = text[len(digits) :]
    try:
        return float(digits) * _SUFFIXES[suffix]
    except (ValueError, KeyError):
        return math.nan


def _per_pod_values(hpa: Mapping[str, Any]) -> dict[str, float]:
    """Metric name -> current per-pod average, from status.currentMetrics (Pods or External)."""
    values = {}
    for entry in (hpa.get("status") or {}).get("currentMetrics") or []:
        source = entry.get(str(entry.get("type", "")).lower()) or {}
        name = (source.get("metric") or {}).get("name")
        current = (source.get("current") or {}).get("averageValue")
        if name and current is not None:
            values[str(name)] = metric_value(current)
    return values


def _condition(hpa: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    conditions = (hpa.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def scale_reason(
    server: LLMServer, hpa: Mapping[str, Any], uses_keda: bool, previous_count: int | None
) -> str:
    """Why the autoscaler moved to its desired count, from its status (see module docstring):
    `up 1->3: waitingRequests 4/pod, target 1 (held at maxReplicas)`."""
    status = hpa.get("status") or {}
    desired = int(status.get("desiredReplicas") or 0)
    if previous_count is None or previous_count == desired:
        text = f"to {desired}"
    else:
        direction = "up" if desired > previous_count else "down"
        text = f"{direction} {previous_count}->{desired}"
    values = _per_pod_values(hpa)
    ratios = [
        (values[name] / target, key, values[name], target)
        for name, (key, target) in metric_keys(server, uses_keda).items()
        if name in values and not math.isnan(values[name])
    ]
    if ratios:
        _, key, value, target = max(ratios)
        text += f": {key} {value:g}/pod, target {target:g}"
    limited = _condition(hpa, "ScalingLimited")
    bounds = {"TooFewReplicas": "minReplicas", "TooManyReplicas": "maxReplicas"}
    bound = bounds.get(str(limited.get("reason"))) if limited.get("status") == "True" else None
    spec = server.spec.autoscaling
    if bound is None and spec is not None and previous_count is not None:
        # A count set outside the bounds is brought back without reading any metric.
        if previous_count > spec.max_replicas and desired == spec.max_replicas:
            bound = "maxReplicas"
        elif previous_count < spec.min_replicas and desired == spec.min_replicas:
            bound = "minReplicas"
    if bound is not None:
        text += f" (held at {bound})"
    return text


def _count_before(
    hpa: Mapping[str, Any], previous: AutoscalingStatus | None, recorded: int | None
) -> int | None:
    """The count before the autoscaler's last change. Right after a change its status still
    has the count it started from (currentReplicas); read later, the change is known only from
    what status recorded: the autoscaler's previous desired count, else the Deployment's."""
    status = hpa.get("status") or {}
    desired = status.get("desiredReplicas")
    for candidate in (
        status.get("currentReplicas"),
        previous.desired_replicas if previous is not None else None,
        recorded,
    ):
        if candidate and candidate != desired:
            return int(candidate)
    return None


def autoscaling_status(
    server: LLMServer,
    hpa: Mapping[str, Any] | None,
    uses_keda: bool,
    previous: AutoscalingStatus | None,
    count_before: int | None,
) -> AutoscalingStatus | None:
    """status.autoscaling from the autoscaler's HorizontalPodAutoscaler (None: not made yet).

    The reason is worked out only when lastScaleTime moves; `count_before` is the count status
    recorded before (status.desiredReplicas).
    """
    if not server.spec.is_autoscaled:
        return None
    kind: AutoscalerKind = "ScaledObject" if uses_keda else "HorizontalPodAutoscaler"
    name = autoscaler_hpa_name(server, uses_keda)
    if hpa is None:
        return AutoscalingStatus(
            kind=kind, name=name, message=f"{HPA_KIND} {name} does not exist yet"
        )
    status = hpa.get("status") or {}
    scaled_at = parse_or(status.get("lastScaleTime"), None)
    reason = previous.last_scale_reason if previous is not None else None
    if scaled_at and (previous is None or previous.last_scale_time != scaled_at):
        reason = scale_reason(server, hpa, uses_keda, _count_before(hpa, previous, count_before))
    active = _condition(hpa, "ScalingActive")
    message = str(active.get("message", "")) if active.get("status") == "False" else ""
    desired = status.get("desiredReplicas")
    return AutoscalingStatus(
        kind=kind,
        name=name,
        desired_replicas=None if desired is None else int(desired),
        last_scale_time=scaled_at,
        last_scale_reason=reason,
        message=message[:1024],
    )
