"""The canary of a policy change (pure): start, watch, promote or take back.

A change of the pod template's identity (`template_identity`: the memory-policy hash, the
image, the command and arguments, i.e. the policy, the model and the image; not labels or
replicas) with `spec.rollout.canary.enabled` does not roll the Deployment. The Deployment keeps
the template it runs (the stable one) and a canary Deployment runs the new one on
`canary.replicas` pods beside it; with `rollout.maxSurge` 0 the Deployment gives up that many
replicas meanwhile, so the canary needs no spare GPUs. Each reconcile decides:

- no canary wanted (disabled, no Deployment yet, or the template is the running one): roll as
  usual; a Promoted or Failed record stays until the template changes again;
- a template that already failed: keep the stable template, no canary (never retried);
- a template that was promoted: the Deployment takes it;
- otherwise analyze: a `failOn` signal of a canary pod fails it at once (with its value);
  `analysisSeconds` after the start with every canary pod ready, it is promoted. A new
  template under test restarts the analysis; an operator restart resumes from `status.canary`.

The signals: OOM terminations and container restarts from the canary pods' status, and the
memory alerts fragmentation, kvCacheSaturation, engineStalled and oomEvents as remediation
recorded them for canary pods since the start (an eviction of a canary pod counts only through
such an alert). Where the operator knows the Prometheus that evaluates those alerts, a canary
without its data holds and, past a bound, is taken back (`canary_data`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.rollout import CanarySpec, CanaryStatus
from pagekeeper_operator.api.runtime import TRIGGER_BY_KEY
from pagekeeper_operator.policy.adaptive import classify_failure
from pagekeeper_operator.render.meta import POLICY_HASH_ANNOTATION
from pagekeeper_operator.rollout.canary_data import NO_DATA_SIGNAL, CanaryData, track_data
from pagekeeper_operator.timestamps import format_time

CANARY_LABEL = "pagekeeper.dev/canary"
CANARY_SUFFIX = "-canary"
# failOn signals read from remediation's records, by the alert each is.
_ALERT_SIGNALS = ("fragmentation", "kvCacheSaturation", "engineStalled", "oomEvents")
# How long a ready canary may go without Prometheus's data before it is taken back
# (PAGEKEEPER_CANARY_NO_DATA_SECONDS).
DEFAULT_NO_DATA_SECONDS = 600


def canary_name(server_name: str) -> str:
    return f"{server_name}{CANARY_SUFFIX}"


def template_identity(template: Mapping[str, Any]) -> str:
    """What a canary tests of a pod template: its policy hash, images, commands and args."""
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    facts = {
        "policy": annotations.get(POLICY_HASH_ANNOTATION),
        "containers": [
            [c.get("name"), c.get("image"), c.get("command"), c.get("args")] for c in containers
        ],
    }
    text = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CanaryPod:
    """A canary pod as its status shows it."""

    name: str
    is_ready: bool
    restarts: int
    oom_terminations: int


@dataclass(frozen=True)
class CanaryEvent:
    """An Event of a transition. `key` names the transition from the record it started from,
    which every reconcile that reads that record computes alike: two racing reconciles (a
    resync and a handler) post it once (`reconcile._post_event`)."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    key: str = field(default="", compare=False)  # not what the Event says: how it is posted


@dataclass(frozen=True)
class CanaryPlan:
    """What the reconcile renders and records."""

    main_runs_candidate: bool  # False: the Deployment keeps the template it runs
    main_replicas: int
    canary_replicas: int  # 0: no canary Deployment
    status: CanaryStatus | None
    event: CanaryEvent | None = None


def _roll(
    replicas: int, status: CanaryStatus | None, event: CanaryEvent | None = None
) -> CanaryPlan:
    return CanaryPlan(True, replicas, 0, status, event)


def _hold(
    replicas: int, status: CanaryStatus | None, event: CanaryEvent | None = None
) -> CanaryPlan:
    return CanaryPlan(False, replicas, 0, status, event)


def decide_canary(
    spec: CanarySpec,
    *,
    replicas: int,
    max_surge: int,
    candidate: str,
    stable: str | None,
    previous: CanaryStatus | None,
    pods: Sequence[CanaryPod],
    history: Sequence[RemediationRecord],
    server_name: str,
    now: datetime,
    data: CanaryData | None = None,
    no_data_seconds: int = DEFAULT_NO_DATA_SECONDS,
) -> CanaryPlan:
    """The plan for this reconcile (see the module docstring); `data` is what Prometheus said
    of the canary pods (None: no Prometheus to ask)."""
    if previous is not None and previous.template_hash == candidate:
        if previous.phase == "Failed":
            return _hold(replicas, previous)
        if previous.phase == "Promoted":
            return _roll(replicas, previous)
    if not spec.enabled or stable is None or stable == candidate:
        kept = previous if previous is not None and previous.template_hash == candidate else None
        return _roll(replicas, kept)
    analyzing = replicas - spec.replicas if max_surge == 0 else replicas
    if previous is None or previous.phase != "Analyzing" or previous.template_hash != candidate:
        started = CanaryStatus(
            phase="Analyzing",
            template_hash=candidate,
            stable_template_hash=stable,
            started_at=now,
            message=(
                f"{spec.replicas} canary pod(s) run the new template for {spec.analysis_seconds}s"
            ),
        )
        event = CanaryEvent("Normal", "CanaryStarted", started.message, _key(candidate, previous))
        return CanaryPlan(False, analyzing, spec.replicas, started, event)
    failure = _failure(spec, previous, pods, history, server_name)
    if failure is not None:
        signal, message = failure
        failed = previous.model_copy(
            update={
                "phase": "Failed",
                "finished_at": now,
                "failed_signal": signal,
                "message": message,
            }
        )
        return _hold(
            replicas, failed, CanaryEvent("Warning", "CanaryFailed", message, _key("", previous))
        )
    ready = sum(p.is_ready for p in pods)
    clean_from = previous.started_at
    if data is not None and ready >= spec.replicas:
        watched, data_event, has_data = _watched(spec, previous, data, pods, now, no_data_seconds)
        if watched.phase == "Failed":
            return _hold(replicas, watched, data_event)
        if not has_data:
            return CanaryPlan(False, analyzing, spec.replicas, watched, data_event)
        previous = watched
        assert previous.data_since is not None, "a watched canary has data since a time"
        clean_from = max(clean_from, previous.data_since)
    is_due = now >= clean_from + timedelta(seconds=spec.analysis_seconds)
    if is_due and ready >= spec.replicas:
        message = (
            f"{ready} canary pod(s) ran clean for {spec.analysis_seconds}s: the new template "
            f"rolls to all {replicas} replicas"
        )
        promoted = previous.model_copy(
            update={"phase": "Promoted", "finished_at": now, "message": message}
        )
        event = CanaryEvent("Normal", "CanaryPromoted", message, _key("", previous))
        return _roll(replicas, promoted, event)
    return CanaryPlan(False, analyzing, spec.replicas, previous)


def _key(what: str, previous: CanaryStatus | None) -> str:
    """A transition's identity: `what` it moves to, and the analysis it moves from."""
    if previous is None:
        return f"{what}|none"
    return f"{what}|{previous.template_hash}|{format_time(previous.started_at)}|{previous.phase}"


def _text(when: datetime | None) -> str:
    return "?" if when is None else format_time(when)


def _watched(
    spec: CanarySpec,
    previous: CanaryStatus,
    data: CanaryData,
    pods: Sequence[CanaryPod],
    now: datetime,
    no_data_seconds: int,
) -> tuple[CanaryStatus, CanaryEvent | None, bool]:
    """The record with this reconcile's data, its Event, and whether the canary has data.
    Without data it holds, saying why (an Event when the gap starts), and past the bound it
    fails on noData."""
    ready_pods = [p.name for p in pods if p.is_ready]
    tracked, missing = track_data(previous, data, ready_pods, now)
    if missing is None:
        if previous.data_missing_since is not None:  # back after a gap: the clock restarts
            message = (
                f"{spec.replicas} canary pod(s) run the new template for "
                f"{spec.analysis_seconds}s, counted from {_text(tracked.data_since)}: data resumed"
            )
            return tracked.model_copy(update={"message": message}), None, True
        return tracked, None, True
    assert tracked.data_missing_since is not None, "missing data has a start"
    deadline = tracked.data_missing_since + timedelta(seconds=no_data_seconds)
    if now >= deadline:
        message = (
            f"{NO_DATA_SIGNAL}: no data for the canary pods since "
            f"{format_time(tracked.data_missing_since)} "
            f"({missing}); taken back after {no_data_seconds}s rather than promoted unwatched"
        )[:1024]
        failed = tracked.model_copy(
            update={
                "phase": "Failed",
                "finished_at": now,
                "failed_signal": NO_DATA_SIGNAL,
                "message": message,
            }
        )
        return failed, CanaryEvent("Warning", "CanaryFailed", message, _key("", previous)), False
    message = (
        f"holding: {missing}; the canary is not promoted without data, and is taken back at "
        f"{format_time(deadline)} if none comes"
    )[:1024]
    held = tracked.model_copy(update={"message": message})
    if previous.data_missing_since is not None:
        return held, None, False  # the gap goes on: said when it began
    # One gap a stretch of data: the stretch that ended (none yet: the first) names it.
    key = _key(_text(previous.data_since), previous)
    return held, CanaryEvent("Warning", "CanaryNoData", message, key), False


def _failure(
    spec: CanarySpec,
    status: CanaryStatus,
    pods: Sequence[CanaryPod],
    history: Sequence[RemediationRecord],
    server_name: str,
) -> tuple[str, str] | None:
    """The first failOn signal seen, with its value, or None."""
    fail_on = set(spec.fail_on)
    if "oomEvents" in fail_on:
        ooms = sum(p.oom_terminations for p in pods)
        if ooms:
            return "oomEvents", (
                f"oomEvents: {ooms} out-of-memory or stuck termination(s) of canary pods"
            )
    if "restarts" in fail_on:
        restarts = sum(p.restarts for p in pods)
        if restarts:
            return "restarts", f"restarts: {restarts} container restart(s) of canary pods"
    prefix = f"{server_name}{CANARY_SUFFIX}-"
    alerts = {TRIGGER_BY_KEY[key].alert: key for key in _ALERT_SIGNALS if key in fail_on}
    for record in history:
        if (
            record.alert in alerts
            and record.pod.startswith(prefix)
            and record.action != "step-down"
            and record.time >= status.started_at
        ):
            signal = alerts[record.alert]
            return signal, f"{signal}: {record.alert} fired for canary pod {record.pod}"
    return None


def canary_pod(pod: Mapping[str, Any]) -> CanaryPod:
    """A pod as the decision reads it: ready, restarts, out-of-memory terminations."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    conditions = status.get("conditions") or []
    ooms = set()
    for container in statuses:
        for state in (container.get("state"), container.get("lastState")):
            terminated = (state or {}).get("terminated") or {}
            if classify_failure(terminated.get("reason"), terminated.get("message")):
                ooms.add((container.get("name"), terminated.get("finishedAt")))
    return CanaryPod(
        name=str((pod.get("metadata") or {}).get("name", "")),
        is_ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        restarts=sum(int(c.get("restartCount") or 0) for c in statuses),
        oom_terminations=len(ooms),
    )


def shape_deployments(
    desired: Sequence[Mapping[str, Any]],
    plan: CanaryPlan,
    stable_template: Mapping[str, Any] | None,
    owns_replicas: bool = True,
) -> list[dict[str, Any]]:
    """`desired` with the Deployment running the stable template and the plan's replicas, and
    the canary Deployment after it when the plan has canary pods. Without `owns_replicas` (an
    autoscaler owns the Deployment's count) the Deployment's replicas stay unrendered and the
    canary pods come beside the autoscaled ones."""
    shaped: list[dict[str, Any]] = []
    for manifest in desired:
        obj = copy.deepcopy(dict(manifest))
        shaped.append(obj)
        if obj["kind"] != "Deployment":
            continue
        candidate = copy.deepcopy(obj)
        if not plan.main_runs_candidate and stable_template is not None:
            obj["spec"]["template"] = copy.deepcopy(dict(stable_template))
        if owns_replicas:
            obj["spec"]["replicas"] = plan.main_replicas
        if plan.canary_replicas > 0:
            shaped.append(_canary_deployment(candidate, plan.canary_replicas))
    return shaped


def _canary_deployment(main: dict[str, Any], replicas: int) -> dict[str, Any]:
    canary = main
    canary["metadata"]["name"] = canary_name(main["metadata"]["name"])
    canary["metadata"]["labels"] = {**canary["metadata"]["labels"], CANARY_LABEL: "true"}
    canary["spec"]["replicas"] = replicas
    selector = canary["spec"]["selector"]["matchLabels"]
    canary["spec"]["selector"]["matchLabels"] = {**selector, CANARY_LABEL: "true"}
    labels = canary["spec"]["template"]["metadata"]["labels"]
    canary["spec"]["template"]["metadata"]["labels"] = {**labels, CANARY_LABEL: "true"}
    return canary
