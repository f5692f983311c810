"""One reconcile of one LLMServer: tune (`tuning.step`: observe, recommend, decide a trial),
compose the effective policy once (`effective.compose`), render, plan, apply what the plan
says, compute status; render, the memory plan and status all read that one composition.

The handlers (and the remediation code, after it steps a policy down) call `reconcile`; it
writes children only when the plan says so, and returns the status patch for the caller to
write, empty when nothing changed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.adapters.plan import Apply, ObjectKey, key_of, plan, prune
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.controllers.rollout_steps import (
    hand_over,
    observed_autoscaling,
    record_canary_outcome,
    with_canary,
)
from pagekeeper_operator.failures import is_permanent
from pagekeeper_operator.faultpoints import FaultPoint, reached, reached_canary
from pagekeeper_operator.metrics import count_tuning
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.fit import (
    POLICY_FITS,
    FitOutcome,
    decide_fit,
    hold_rollout,
    node_selector,
)
from pagekeeper_operator.remediation.actions import event
from pagekeeper_operator.render import render_all, unwanted_objects
from pagekeeper_operator.render.autoscaler import HPA_KIND
from pagekeeper_operator.rollout.canary import (
    DEFAULT_NO_DATA_SECONDS,
    CanaryEvent,
    canary_name,
)
from pagekeeper_operator.status.api_key import (
    API_KEY_AVAILABLE,
    ApiKeyCheck,
    api_key_event,
    check_api_key,
)
from pagekeeper_operator.status.conditions import compute_status
from pagekeeper_operator.status.patch import status_patch
from pagekeeper_operator.status.refusal import write_failure
from pagekeeper_operator.timestamps import format_time, parse_time, utc_now
from pagekeeper_operator.tuning.decide import TuningEvent
from pagekeeper_operator.tuning.step import observe, promote_canary
from pagekeeper_operator.tuning.tuner import tune

logger = logging.getLogger(__name__)
# The canary's outcomes, written to status before any object moves
# (`rollout_steps.record_canary_outcome`).
CANARY_OUTCOMES = frozenset({"CanaryPromoted", "CanaryFailed"})


@dataclass
class ReconcileResult:
    """What a reconcile did and what status it wants written."""

    applied: list[Apply] = field(default_factory=list)
    deleted: list[ObjectKey] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    error: ApiException | None = None

    @property
    def is_permanent_error(self) -> bool:
        """A refusal (`failures.is_permanent_status`): the spec (or a render bug) is at fault."""
        return self.error is not None and is_permanent(self.error)


def _describe(action: Apply, exc: ApiException) -> str:
    """The raw answer, for the log and an Event; status gets `refusal.write_failure`."""
    _, kind, name = key_of(action.manifest)
    return f"applying {kind}/{name} failed ({exc.status} {exc.reason}): {exc.body or ''}"[:2000]


def reconcile(
    kube: Kube,
    server: LLMServer,
    default_images: Mapping[str, str],
    now: str | None = None,
    prometheus_url: str | None = None,
    canary_no_data_seconds: int = DEFAULT_NO_DATA_SECONDS,
) -> ReconcileResult:
    """Bring the server's children to the rendered state; return the status to write.

    `prometheus_url` is where KEDA's triggers query (a ScaledObject is rendered only with one)
    and where a canary's data is looked for (`canary_data`, bounded by
    `canary_no_data_seconds`).
    """
    namespace = server.metadata.namespace
    features = replace(kube.features(), prometheus_url=prometheus_url)
    now = now or format_time(utc_now())
    stored = server  # the status patch is the difference from what the API server holds
    nodes = _candidate_nodes(kube, server)
    server, tuning_events = _with_tuning(server, prometheus_url, now, nodes)
    composed = effective.compose(server)
    # The pods run the composed policy, with the change under trial if any (the canary's).
    desired = render_all(server, default_images, features, composed.rendered)
    fit = decide_fit(server, composed.rendered, nodes)
    api_key = _check_api_key(kube, server)
    if fit.holds_rollout or (api_key is not None and api_key.holds_rollout):
        running = kube.get("apps/v1", "Deployment", namespace, server.metadata.name)
        desired = hold_rollout(desired, running)
    canary_event = None
    if any(m["kind"] == "Deployment" for m in desired):
        watch = (prometheus_url, canary_no_data_seconds)
        desired, server, canary_event = with_canary(kube, server, desired, parse_time(now), watch)
        reached_canary(canary_event, "decided")
    result = ReconcileResult()
    if canary_event is not None and canary_event.reason in CANARY_OUTCOMES:
        result.error = record_canary_outcome(kube, stored, server)
        if result.error is not None:
            return result
    observed = kube.observe(namespace, [key_of(m) for m in desired])
    result.error, error_text = hand_over(kube, server, observed)
    actions = plan(desired, observed) if result.error is None else []
    for action in actions:
        key = key_of(action.manifest)
        try:
            observed[key] = kube.apply(action.manifest)
        except ApiException as exc:
            result.error = exc
            raw = _describe(action, exc)
            logger.warning("%s/%s: %s", namespace, server.metadata.name, raw)
            error_text = write_failure(key[1], exc.status, exc.reason, exc.body)
            # Once per failure: the resync retries a stalled server without a new Event each time.
            degraded = stored.status.condition("Degraded")
            if degraded is None or degraded.message != error_text:
                _post_event(kube, server, "Warning", "ApplyFailed", raw[:1024])
            break
        result.applied.append(action)
        logger.info(
            "%s/%s: applied %s/%s (%s)",
            namespace,
            server.metadata.name,
            key[1],
            key[2],
            action.reason,
        )
    reached_canary(canary_event, "applied")
    if any(action.manifest["kind"] == HPA_KIND for action in result.applied):
        reached(FaultPoint.AUTOSCALING_APPLIED)
    if result.error is None:
        unwanted = unwanted_objects(server, features)
        if not any(key_of(m)[2] == canary_name(server.metadata.name) for m in desired):
            unwanted.append(("apps/v1", "Deployment", canary_name(server.metadata.name)))
        error_text = _prune(kube, server, unwanted, result)
        reached_canary(canary_event, "pruned")
    if result.error is None and canary_event is not None:
        _post_event(
            kube, server, canary_event.type, canary_event.reason, canary_event.message,
            canary_event.key,
        )  # fmt: skip
    fit_event = _fit_event(server, fit)
    if fit_event is not None:
        _post_event(kube, server, fit_event.type, fit_event.reason, fit_event.message)
    key_event = api_key_event(server.status.condition(API_KEY_AVAILABLE), api_key)
    if key_event is not None:
        _post_event(kube, server, *key_event)
    if result.error is None:
        for tuning_event in tuning_events:
            _post_event(kube, server, tuning_event.type, tuning_event.reason, tuning_event.message)
    deployment = observed.get(("apps/v1", "Deployment", server.metadata.name))
    autoscaling = observed_autoscaling(kube, server, features, observed)
    status = compute_status(
        server, deployment, now, error_text, autoscaling, fit, api_key, composed
    )
    result.status_patch = status_patch(stored, status)
    return result


def _candidate_nodes(kube: Kube, server: LLMServer) -> list[dict[str, Any]]:
    """The nodes the pods may land on, for the memory plan; nodes that cannot be listed leave
    the GPU to the spec (or unknown)."""
    selector = ",".join(f"{key}={value}" for key, value in node_selector(server).items())
    try:
        return kube.list_nodes(selector)
    except ApiException as exc:
        logger.warning("listing nodes for the memory plan failed (%s %s)", exc.status, exc.reason)
        return []


def _fit_event(server: LLMServer, fit: FitOutcome) -> CanaryEvent | None:
    """A Warning when the plan stops fitting (or fails differently): the rollout is held."""
    status, reason, message = fit.condition
    previous = server.status.condition(POLICY_FITS)
    if status != "False" or (
        previous is not None and previous.status == "False" and previous.reason == reason
    ):
        return None
    return CanaryEvent("Warning", "PolicyDoesNotFit", message)


def _check_api_key(kube: Kube, server: LLMServer) -> ApiKeyCheck | None:
    """spec.apiKey's Secret as the API server holds it (`api_key`); its values stay here."""
    ref = server.spec.api_key
    if ref is None:
        return None
    try:
        secret = kube.get("v1", "Secret", server.metadata.namespace, ref.secret_name)
    except ApiException as exc:
        logger.warning("reading Secret %s failed (%s %s)", ref.secret_name, exc.status, exc.reason)
        return check_api_key(server, None, unreadable=f"{exc.status} {exc.reason}")
    return check_api_key(server, secret)


def _with_tuning(
    server: LLMServer, prometheus_url: str | None, now: str, nodes: list[dict[str, Any]]
) -> tuple[LLMServer, list[TuningEvent]]:
    """The server with its new recommendations and tuning status (`tuning.tuner`), and the
    Events to post; a won trial marks its canary Promoted so every replica takes it. A trial
    whose candidate the memory plan would hold never starts (or ends at once)."""

    def does_not_fit(trying: LLMServer, policy: MemoryPolicy) -> str | None:
        fit = decide_fit(trying, policy, nodes)
        return fit.status.message if fit.holds_rollout else None

    when = parse_time(now)
    result = tune(server, observe(server, prometheus_url, when), when, does_not_fit)
    reasons = [e.reason for e in result.events]
    count_tuning(server.metadata.namespace, server.metadata.name, result.recommendations, reasons)
    canary = server.status.canary
    if result.promoted is not None:
        canary = promote_canary(canary, when)
    status = server.status.model_copy(
        update={
            "recommendations": result.recommendations,
            "tuning": result.tuning,
            "canary": canary,
        }
    )
    return server.model_copy(update={"status": status}), result.events


def _post_event(
    kube: Kube,
    server: LLMServer,
    type_: Literal["Normal", "Warning"],
    reason: str,
    message: str,
    key: str = "",
) -> None:
    """An Event on the LLMServer; best effort (status holds the record). With a transition's
    `key` the Event's name is made from it, so a second reconcile that saw the same transition
    (a resync racing a handler) finds it there (409) and posts nothing."""
    meta = server.metadata
    body = event(meta.namespace, meta.name, meta.uid, type_, reason, message)
    if key:
        digest = hashlib.sha256(f"{meta.uid}|{reason}|{key}".encode()).hexdigest()[:16]
        body["metadata"] = {"name": f"{meta.name}.{digest}", "namespace": meta.namespace}
    try:
        kube.create_event(body)
    except ApiException as exc:
        if key and exc.status == 409:
            logger.debug("%s of this transition was posted already", reason)
            return
        logger.warning("could not post %s: %s %s", reason, exc.status, exc.reason)


def _prune(
    kube: Kube, server: LLMServer, unwanted: list[ObjectKey], result: ReconcileResult
) -> str | None:
    """Delete the objects the spec no longer wants; the error text of a failure."""
    namespace = server.metadata.namespace
    if not unwanted:
        return None
    for delete in prune(unwanted, kube.observe(namespace, unwanted), server.metadata.uid):
        key = delete.key
        try:
            kube.delete(key, namespace, uid=delete.uid)
        except ApiException as exc:
            result.error = exc
            text = f"deleting {key[1]}/{key[2]} failed ({exc.status} {exc.reason})"
            logger.warning("%s/%s: %s", namespace, server.metadata.name, text)
            return text
        result.deleted.append(key)
        logger.info("%s/%s: deleted %s/%s", namespace, server.metadata.name, key[1], key[2])
    return None
