"""kopf wiring of remediation: the Alertmanager webhook server, the retry loop for deferred
alerts, the pod-age loop of spec.lifecycle.maxPodAge (`pod_age_loop`), and the out-of-memory
watcher that steps the effective policy down and then reconciles the server at once, so the
pods roll to the lowered policy without waiting for the resync.

Its settings (port, token file, TLS) are `settings.OperatorSettings`' webhook fields; the TLS
pair is read again when its files change (`tls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.kube import shared_kube
from pagekeeper_operator.controllers.pod_age_loop import AGE_INTERVAL_SECONDS, PodAgeLoop
from pagekeeper_operator.controllers.resync import (
    ServerReconciler,
    ServerRegistry,
    server_reconciler,
)
from pagekeeper_operator.faultpoints import FaultPoint, reached
from pagekeeper_operator.metrics import count_remediation
from pagekeeper_operator.policy.adaptive import Termination
from pagekeeper_operator.remediation.actions import KubeClusterPort, is_server_pod
from pagekeeper_operator.remediation.oom import (
    OOMResponse,
    oom_terminations,
    respond_to_oom,
    termination_key,
)
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.tls import ReloadingServerContext
from pagekeeper_operator.remediation.webhook import make_app
from pagekeeper_operator.render.meta import SERVER_LABEL
from pagekeeper_operator.settings import SettingsError, load_settings
from pagekeeper_operator.timestamps import utc_now

logger = logging.getLogger(__name__)
# Deferred alerts (hysteresis, cooldown, maxUnavailable, a PodDisruptionBudget) are decided
# again this often while they keep firing.
RETRY_INTERVAL_SECONDS = 15.0
MEMO_KEY = "remediation"
# The Service reaches the pod on its own address, so listen on all of them.
LISTEN_HOST = "0.0.0.0"


def read_token(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


@dataclass
class RemediationRuntime:
    """What the startup handler starts and the cleanup handler stops."""

    port: KubeClusterPort
    remediator: Remediator
    reconcile_server: ServerReconciler
    runner: web.AppRunner | None = None
    retry_task: asyncio.Task[None] | None = None
    age_task: asyncio.Task[None] | None = None
    seen_terminations: set[str] = field(default_factory=set)


def _known_servers(memo: kopf.Memo) -> list[tuple[str, str]]:
    """The servers the LLMServer handlers have seen (`handlers.start_resync`'s registry)."""
    registry = memo.get("servers")
    return registry.snapshot() if isinstance(registry, ServerRegistry) else []


async def _retry_loop(remediator: Remediator, memo: kopf.Memo) -> None:
    while True:
        await asyncio.sleep(RETRY_INTERVAL_SECONDS)
        try:
            # What a killed predecessor left open is settled even if no alert comes again.
            await remediator.resume(_known_servers(memo))
            decisions = await remediator.retry_due()
        except Exception:
            # The API may be briefly unavailable; the alerts stay deferred for the next round.
            logger.exception("retrying deferred alerts failed")
            continue
        for decision in decisions:
            logger.info(
                "retried %s on %s/%s: %s",
                decision.alert,
                decision.namespace,
                decision.pod,
                decision.reason or decision.verdict,
            )


@kopf.on.startup()
async def start_remediation(memo: kopf.Memo, **_: Any) -> None:
    try:
        settings = load_settings(os.environ)
    except SettingsError as error:
        raise kopf.PermanentError(str(error)) from error
    kube = shared_kube(memo, os.environ)
    port = KubeClusterPort(kube)
    runtime = RemediationRuntime(
        port=port,
        remediator=Remediator(port),
        reconcile_server=server_reconciler(kube, settings),
    )
    memo[MEMO_KEY] = runtime
    # spec.lifecycle.maxPodAge acts whether or not the webhook is on.
    ages = PodAgeLoop(port, runtime.remediator)
    runtime.age_task = asyncio.create_task(
        ages.run_forever(lambda: _known_servers(memo), AGE_INTERVAL_SECONDS)
    )
    token_file = settings.webhook_token_file
    if token_file is None:
        logger.warning("PAGEKEEPER_WEBHOOK_TOKEN_FILE is not set: the Alertmanager webhook is off")
        return
    if not read_token(token_file):
        raise kopf.PermanentError(f"PAGEKEEPER_WEBHOOK_TOKEN_FILE={token_file} is empty")
    app = make_app(lambda: read_token(token_file), runtime.remediator.handle)
    runtime.runner = web.AppRunner(app, access_log=None)
    await runtime.runner.setup()
    ssl_context = None
    if settings.webhook_tls_cert_file is not None and settings.webhook_tls_key_file is not None:
        # Each new connection reads the files again (`tls`): a renewed Secret needs no restart.
        cert, key = settings.webhook_tls_cert_file, settings.webhook_tls_key_file
        ssl_context = ReloadingServerContext(cert, key).context
    site = web.TCPSite(runtime.runner, LISTEN_HOST, settings.webhook_port, ssl_context=ssl_context)
    await site.start()
    runtime.retry_task = asyncio.create_task(_retry_loop(runtime.remediator, memo))
    logger.info("Alertmanager webhook listening on port %d", settings.webhook_port)


@kopf.on.cleanup()
async def stop_remediation(memo: kopf.Memo, **_: Any) -> None:
    runtime = memo.get(MEMO_KEY)
    if not isinstance(runtime, RemediationRuntime):
        return
    for task in (runtime.retry_task, runtime.age_task):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if runtime.runner is not None:
        await runtime.runner.cleanup()


@kopf.on.event("", "v1", "pods", labels={SERVER_LABEL: kopf.PRESENT})
async def pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Classify and respond to each out-of-memory termination of a server's pod, once."""
    runtime = memo.get(MEMO_KEY)
    if not isinstance(runtime, RemediationRuntime) or not is_server_pod(body):
        return
    metadata = body.get("metadata", {})
    namespace, pod = str(metadata.get("namespace")), str(metadata.get("name"))
    server = str(metadata.get("labels", {}).get(SERVER_LABEL))
    for container, classification, finished_at in oom_terminations(body):
        key = termination_key(str(metadata.get("uid")), container, finished_at)
        if key in runtime.seen_terminations:
            continue
        reached(FaultPoint.STEPDOWN_CLASSIFIED)
        await _respond(runtime, namespace, server, pod, classification, key, finished_at)
        runtime.seen_terminations.add(key)


async def _respond(
    runtime: RemediationRuntime,
    namespace: str,
    server: str,
    pod: str,
    classification: Termination,
    key: str,
    finished_at: str,
) -> None:
    written: list[OOMResponse] = []

    def change(body: dict[str, Any]) -> dict[str, Any] | None:
        response = respond_to_oom(body, pod, classification, key, finished_at, utc_now())
        written[:] = [] if response is None else [response]
        # None: already recorded (before a restart, or by another replica).
        return None if response is None else response.status

    if await runtime.port.update_server_status(namespace, server, change) is None:
        return
    [response] = written
    reached(FaultPoint.STEPDOWN_RECORDED)
    logger.warning("%s/%s: %s", namespace, pod, response.record.message)
    count_remediation(namespace, server, response.record)
    await runtime.port.emit_event(
        namespace, server, response.event_type, response.event_reason, response.record.message
    )
    reached(FaultPoint.STEPDOWN_EVENT_POSTED)
    if response.record.outcome == "applied":
        try:
            await runtime.reconcile_server(namespace, server)
            reached(FaultPoint.STEPDOWN_ROLLED_OUT)
        except ApiException as error:
            # Status holds the lowered policy; the periodic resync rolls it out.
            logger.warning("%s/%s: reconcile failed: %s", namespace, server, error)
