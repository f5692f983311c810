"""kopf wiring of remediation: the Alertmanager webhook server, the retry loop for deferred
alerts, and the out-of-memory watcher that steps the effective policy down and then reconciles
the server at once, so the pods roll to the lowered policy without waiting for the resync.

Settings (environment; the chart mounts the token from a Secret):

PAGEKEEPER_WEBHOOK_PORT (default: 8443)
    Port of the webhook receiver (`POST /alertmanager`, `GET /healthz`).
PAGEKEEPER_WEBHOOK_TOKEN_FILE (no default)
    File holding the bearer token Alertmanager must send; read on every request, so a rotated
    Secret applies without a restart. Unset: the receiver is not started (logged as a warning).
PAGEKEEPER_WEBHOOK_TLS_CERT_FILE, PAGEKEEPER_WEBHOOK_TLS_KEY_FILE (optional)
    Serve HTTPS with this certificate and key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
import kubernetes
from aiohttp import web
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adaptive import OOMClassification
from pagekeeper_operator.kube import Kube
from pagekeeper_operator.metrics import count_remediation
from pagekeeper_operator.remediation.actions import KubeClusterPort
from pagekeeper_operator.remediation.oom import oom_terminations, respond_to_oom, termination_key
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.webhook import make_app
from pagekeeper_operator.render.meta import SERVER_LABEL
from pagekeeper_operator.resync import ServerReconciler, server_reconciler
from pagekeeper_operator.settings import load_settings

logger = logging.getLogger(__name__)
TOKEN_FILE_ENV = "PAGEKEEPER_WEBHOOK_TOKEN_FILE"
TLS_CERT_ENV = "PAGEKEEPER_WEBHOOK_TLS_CERT_FILE"
TLS_KEY_ENV = "PAGEKEEPER_WEBHOOK_TLS_KEY_FILE"
# Deferred alerts (hysteresis, cooldown, maxUnavailable, a PodDisruptionBudget) are decided
# again this often while they keep firing.
RETRY_INTERVAL_SECONDS = 15.0
MAX_CONFLICT_RETRIES = 5
MEMO_KEY = "remediation"


@dataclass(frozen=True)
class WebhookSettings:
    """Where and how the receiver listens; see the module docstring."""

    port: int
    token_file: Path | None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # The Service reaches the pod on its own address, so listen on all of them.
    host: str = "0.0.0.0"


def webhook_settings(env: Mapping[str, str]) -> WebhookSettings:
    def path(name: str) -> Path | None:
        text = env.get(name, "").strip()
        return Path(text) if text else None

    cert, key = path(TLS_CERT_ENV), path(TLS_KEY_ENV)
    if (cert is None) != (key is None):
        raise kopf.PermanentError(f"set both {TLS_CERT_ENV} and {TLS_KEY_ENV}, or neither")
    return WebhookSettings(
        port=load_settings(env).webhook_port,
        token_file=path(TOKEN_FILE_ENV),
        tls_cert_file=cert,
        tls_key_file=key,
    )


def api_client(env: Mapping[str, str]) -> kubernetes.client.ApiClient:
    """A client of its own (the global default configuration is left alone): $KUBECONFIG or
    ~/.kube/config when present, else the pod's service account."""
    configuration = kubernetes.client.Configuration()
    kubeconfig = env.get("KUBECONFIG", "").strip()
    if not kubeconfig and Path("~/.kube/config").expanduser().exists():
        kubeconfig = str(Path("~/.kube/config").expanduser())
    if kubeconfig:
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
    else:
        kubernetes.config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    return kubernetes.client.ApiClient(configuration)


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
    seen_terminations: set[str] = field(default_factory=set)


async def _retry_loop(remediator: Remediator) -> None:
    while True:
        await asyncio.sleep(RETRY_INTERVAL_SECONDS)
        try:
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
    settings = webhook_settings(os.environ)
    api = api_client(os.environ)
    port = KubeClusterPort(api)
    reconciler = server_reconciler(Kube(api), load_settings(os.environ).default_images)
    runtime = RemediationRuntime(
        port=port, remediator=Remediator(port), reconcile_server=reconciler
    )
    memo[MEMO_KEY] = runtime
    token_file = settings.token_file
    if token_file is None:
        logger.warning("%s is not set: the Alertmanager webhook is off", TOKEN_FILE_ENV)
        return
    if not read_token(token_file):
        raise kopf.PermanentError(f"{TOKEN_FILE_ENV}={token_file} is empty")
    app = make_app(lambda: read_token(token_file), runtime.remediator.handle)
    runtime.runner = web.AppRunner(app, access_log=None)
    await runtime.runner.setup()
    ssl_context = None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    site = web.TCPSite(runtime.runner, settings.host, settings.port, ssl_context=ssl_context)
    await site.start()
    runtime.retry_task = asyncio.create_task(_retry_loop(runtime.remediator))
    logger.info("Alertmanager webhook listening on port %d", settings.port)


@kopf.on.cleanup()
async def stop_remediation(memo: kopf.Memo, **_: Any) -> None:
    runtime = memo.get(MEMO_KEY)
    if not isinstance(runtime, RemediationRuntime):
        return
    if runtime.retry_task is not None:
        runtime.retry_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runtime.retry_task
    if runtime.runner is not None:
        await runtime.runner.cleanup()


def _is_controlled_by_replica_set(body: Mapping[str, Any]) -> bool:
    refs = body.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("kind") == "ReplicaSet" for ref in refs)


@kopf.on.event("", "v1", "pods", labels={SERVER_LABEL: kopf.PRESENT})
async def pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Classify and respond to each out-of-memory termination of a server's pod, once."""
    runtime = memo.get(MEMO_KEY)
    if not isinstance(runtime, RemediationRuntime) or not _is_controlled_by_replica_set(body):
        return
    metadata = body.get("metadata", {})
    namespace, pod = str(metadata.get("namespace")), str(metadata.get("name"))
    server = str(metadata.get("labels", {}).get(SERVER_LABEL))
    for container, classification, finished_at in oom_terminations(body):
        key = termination_key(str(metadata.get("uid")), container, finished_at)
        if key in runtime.seen_terminations:
            continue
        await _respond(runtime, namespace, server, pod, classification, key, finished_at)
        runtime.seen_terminations.add(key)


async def _respond(
    runtime: RemediationRuntime,
    namespace: str,
    server: str,
    pod: str,
    classification: OOMClassification,
    key: str,
    finished_at: str,
) -> None:
    for _ in range(MAX_CONFLICT_RETRIES):
        body = await runtime.port.read_server_object(namespace, server)
        if body is None:
            return
        response = respond_to_oom(body, pod, classification, key, finished_at, datetime.now(UTC))
        if response is None:
            return  # already recorded (before a restart, or by another replica)
        version = body["metadata"]["resourceVersion"]
        if await runtime.port.patch_server_status(namespace, server, response.status, version):
            logger.warning("%s/%s: %s", namespace, pod, response.record.message)
            count_remediation(namespace, server, response.record)
            await runtime.port.emit_event(
                namespace,
                server,
                response.event_type,
                response.event_reason,
                response.record.message,
            )
            if response.record.outcome == "applied":
                try:
                    await runtime.reconcile_server(namespace, server)
                except ApiException as error:
                    # Status holds the lowered policy; the periodic resync rolls it out.
                    logger.warning("%s/%s: reconcile failed: %s", namespace, server, error)
            return
    raise kopf.TemporaryError(f"status of {namespace}/{server} kept changing", delay=5)
