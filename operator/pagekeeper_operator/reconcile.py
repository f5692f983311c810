"""One reconcile of one LLMServer: render, plan, apply what the plan says, compute status.

The handlers (and the remediation code, after it steps a policy down) call `reconcile`; it
writes children only when the plan says so, and returns the status patch for the caller to
write, empty when nothing changed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.conditions import compute_status, status_patch
from pagekeeper_operator.kube import Kube
from pagekeeper_operator.plan import Apply, ObjectKey, key_of, plan, prune
from pagekeeper_operator.render import render_all, unwanted_objects

logger = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class ReconcileResult:
    """What a reconcile did and what status it wants written."""

    applied: list[Apply] = field(default_factory=list)
    deleted: list[ObjectKey] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    error: ApiException | None = None

    @property
    def is_permanent_error(self) -> bool:
        """A 4xx other than conflict/throttling: the spec (or a render bug) is at fault."""
        return self.error is not None and self.error.status in {400, 403, 404, 422}


def _describe(action: Apply, exc: ApiException) -> str:
    _, kind, name = key_of(action.manifest)
    return f"applying {kind}/{name} failed ({exc.status} {exc.reason}): {exc.body or ''}"[:2000]


def reconcile(
    kube: Kube, server: LLMServer, default_images: Mapping[str, str], now: str | None = None
) -> ReconcileResult:
    """Bring the server's children to the rendered state; return the status to write."""
    namespace = server.metadata.namespace
    features = kube.features()
    desired = render_all(server, default_images, features)
    observed = kube.observe(namespace, [key_of(m) for m in desired])
    result = ReconcileResult()
    error_text: str | None = None
    for action in plan(desired, observed):
        key = key_of(action.manifest)
        try:
            observed[key] = kube.apply(action.manifest)
        except ApiException as exc:
            result.error = exc
            error_text = _describe(action, exc)
            logger.warning("%s/%s: %s", namespace, server.metadata.name, error_text)
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
    if result.error is None:
        error_text = _prune(kube, server, unwanted_objects(server, features), result)
    deployment = next((obj for key, obj in observed.items() if key[1] == "Deployment"), None)
    status = compute_status(server, deployment, now or utc_now(), error_text)
    result.status_patch = status_patch(server, status)
    return result


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


def refresh_status(
    kube: Kube, server: LLMServer, deployment: Mapping[str, Any] | None, now: str | None = None
) -> dict[str, Any]:
    """Write status from an observed Deployment (no applies); returns the patch written.

    Status keeps describing the generation last reconciled: a Deployment event that arrives
    before a newer spec's reconcile (an operator starting after a change made while it was
    down) must not report that spec as observed and Ready on the old pods.
    """
    reconciled = server.status.observed_generation
    if reconciled is None:
        return {}  # nothing reconciled yet: the first reconcile writes status
    if reconciled != server.metadata.generation:
        metadata = server.metadata.model_copy(update={"generation": reconciled})
        server = server.model_copy(update={"metadata": metadata})
    # An apply failure stays reported until a reconcile of this generation succeeds.
    degraded = server.status.condition("Degraded")
    apply_error = None
    if (
        degraded is not None
        and degraded.reason == "ApplyFailed"
        and degraded.observed_generation == server.metadata.generation
    ):
        apply_error = degraded.message
    status = compute_status(server, deployment, now or utc_now(), apply_error)
    patch = status_patch(server, status)
    if patch:
        kube.patch_status(server.metadata.namespace, server.metadata.name, patch)
    return patch
