"""kopf handlers for LLMServer: thin wrappers over `reconcile` (render -> plan -> apply).

- create / update / resume: reconcile, then write status if it changed.
- every LLMServer event: keep the registry that the periodic resync (`resync.py`) walks; no
  kopf timer, because a timer would put a finalizer on every server.
- events of our Deployments: recompute status (replicas ready, rollout progress); events of
  the autoscaler that moved the count: the same.
- delete: nothing to do; owner references let the garbage collector remove the children,
  so deletion never waits on the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import kopf
from pydantic import ValidationError

from pagekeeper_operator.adapters.kube import Kube, shared_kube
from pagekeeper_operator.api.llmserver import API_VERSION, GROUP, KIND, PLURAL, VERSION, LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
from pagekeeper_operator.controllers.refresh import refresh_status
from pagekeeper_operator.controllers.resync import ServerRegistry, resync_forever, server_reconciler
from pagekeeper_operator.controllers.scaledown import keep_deletion_costs
from pagekeeper_operator.metrics import serve_metrics
from pagekeeper_operator.render.meta import MANAGED_BY, SERVER_LABEL
from pagekeeper_operator.settings import load_settings
from pagekeeper_operator.status.progress import unreadable_status
from pagekeeper_operator.timestamps import format_time, parse_or, utc_now

SETTINGS = load_settings()
# Retry delay after a failure the API may get over (conflict, throttling, unavailability).
RETRY_DELAY_SECONDS = 15.0


def _kube(memo: kopf.Memo) -> Kube:
    return shared_kube(memo, os.environ)


def _parse(body: kopf.Body, patch: kopf.Patch) -> LLMServer:
    try:
        return LLMServer.from_body(body)
    except ValidationError as exc:
        # The CRD schema rejects such objects; this one was stored under an older schema (a
        # time stamp written before `format: date-time`, say). Say which fields, in Stalled.
        message, conditions = unreadable_status(body, exc, format_time(utc_now()))
        patch.setdefault("status", {})["conditions"] = conditions
        raise kopf.PermanentError(message) from exc


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = SETTINGS.finalizer
    # Keep kopf's bookkeeping in annotations: the structural schema would prune unknown
    # status fields, and kopf would then never see its own progress.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Successes are logged, not posted: an Event per reconcile would be a write per reconcile.
    settings.posting.level = logging.WARNING
    _kube(memo)
    if SETTINGS.metrics_port is not None:
        serve_metrics(SETTINGS.metrics_port)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, logger: Any, **_: Any) -> None:
    registry = ServerRegistry()
    memo["servers"] = registry
    memo["autoscaled"] = autoscaled = ServerRegistry()
    kube = _kube(memo)
    reconciler = server_reconciler(kube, SETTINGS)
    memo["resync_task"] = asyncio.create_task(
        resync_forever(registry, reconciler, SETTINGS.resync_seconds)
    )
    url = SETTINGS.prometheus_url
    if url is None:
        logger.info("PAGEKEEPER_PROMETHEUS_URL is not set: no pod-deletion costs")
        return
    memo["deletion_cost_task"] = asyncio.create_task(
        keep_deletion_costs(autoscaled, kube, url, SETTINGS.deletion_cost_seconds)
    )


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    for key in ("resync_task", "deletion_cost_task"):
        task = memo.get(key)
        if isinstance(task, asyncio.Task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any) -> None:
    server = _parse(body, patch)
    result = reconcile(
        _kube(memo),
        server,
        SETTINGS.default_images,
        prometheus_url=SETTINGS.prometheus_url,
        canary_no_data_seconds=SETTINGS.canary_no_data_seconds,
    )
    if result.status_patch:
        patch.setdefault("status", {}).update(result.status_patch)
    logger.info(
        "reconciled generation %d: %d applied, status %s",
        server.metadata.generation,
        len(result.applied),
        "changed" if result.status_patch else "unchanged",
    )
    if result.error is not None:
        message = f"reconcile failed: {result.error.status} {result.error.reason}"
        if result.is_permanent_error:
            raise kopf.PermanentError(message)
        raise kopf.TemporaryError(message, delay=RETRY_DELAY_SECONDS)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile_server(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    _reconcile(body, patch, memo, logger)


@kopf.on.event(GROUP, VERSION, PLURAL)
def track_server(
    type: str | None,
    name: str,
    namespace: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Registers the servers the resync repairs drift on and picks stepped-down policies up for,
    and apart those under spec.autoscaling, whose pods get deletion costs."""
    registry, autoscaled = memo.get("servers"), memo.get("autoscaled")
    assert isinstance(registry, ServerRegistry), "the startup handler sets memo.servers"
    assert isinstance(autoscaled, ServerRegistry), "the startup handler sets memo.autoscaled"
    registry.observe(type, str(namespace), name)
    is_autoscaled = (body.get("spec") or {}).get("autoscaling") is not None
    autoscaled.observe(type if is_autoscaled else "DELETED", str(namespace), name)


@kopf.on.event(
    "apps",
    "v1",
    "deployments",
    labels={SERVER_LABEL: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGED_BY},
)
def deployment_changed(
    body: kopf.Body, type: str | None, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    kube = _kube(memo)
    namespace = str(body.metadata.namespace)
    name = str(body.metadata.labels[SERVER_LABEL])
    if body.metadata.name != name:
        return  # a canary Deployment: the reconcile reads its pods, status reads the main one
    obj = kube.get(API_VERSION, KIND, namespace, name)
    if obj is None:
        return  # the server is gone; the garbage collector takes the Deployment too
    deployment = None if type == "DELETED" else dict(body)
    version = obj["metadata"].get("resourceVersion")
    patch = refresh_status(kube, LLMServer.from_body(obj), deployment, resource_version=version)
    if patch:
        logger.debug("status of %s/%s updated: %s", namespace, name, sorted(patch))


@kopf.on.event(
    "autoscaling",
    "v2",
    "horizontalpodautoscalers",
    labels={SERVER_LABEL: kopf.PRESENT},
)
def autoscaler_changed(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """The autoscaler of a server moved its count or stopped being able to: status follows."""
    kube = _kube(memo)
    namespace = str(body.metadata.namespace)
    name = str(body.metadata.labels[SERVER_LABEL])
    obj = kube.get(API_VERSION, KIND, namespace, name)
    if obj is None:
        return
    server = LLMServer.from_body(obj)
    recorded = server.status.autoscaling
    if recorded is None or recorded.name != body.metadata.name:
        return  # not the one the last reconcile recorded; the next reconcile looks again
    status = body.get("status") or {}
    if recorded.desired_replicas == status.get("desiredReplicas") and (
        recorded.last_scale_time == parse_or(status.get("lastScaleTime"), None)
    ):
        return  # only its current metrics moved: nothing status shows
    deployment = kube.get("apps/v1", "Deployment", namespace, name)
    version = obj["metadata"].get("resourceVersion")
    patch = refresh_status(kube, server, deployment, resource_version=version)
    if patch:
        logger.debug("status of %s/%s updated: %s", namespace, name, sorted(patch))


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def server_deleted(name: str, namespace: str | None, logger: Any, **_: Any) -> None:
    # optional=True: no finalizer, so deletion proceeds even while the operator is down.
    logger.info("%s/%s deleted; its children go with it through owner references", namespace, name)
