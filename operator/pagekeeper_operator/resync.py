"""Periodic re-planning of every known LLMServer: drift repair and stepped-down policies.

Not a kopf timer: kopf stops timers through a finalizer, so a timer would put one on every
LLMServer, and with the operator gone (uninstalled, crashed) a server could never be deleted and
its namespace would hang in Terminating. Instead the event stream, which needs no finalizer,
keeps a registry of the servers that exist, and one task re-plans each of them in turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pagekeeper_operator.api.llmserver import API_VERSION, KIND, LLMServer
from pagekeeper_operator.kube import Kube
from pagekeeper_operator.reconcile import reconcile
from pagekeeper_operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

ServerKey = tuple[str, str]  # (namespace, name)
RESYNC_DONE = "resync round done"  # the log line each finished round starts with
ServerReconciler = Callable[[str, str], Awaitable[None]]


class ServerRegistry:
    """The LLMServers this operator has seen and not yet seen deleted."""

    def __init__(self) -> None:
        self._keys: set[ServerKey] = set()

    def observe(self, event_type: str | None, namespace: str, name: str) -> None:
        if event_type == "DELETED":
            self._keys.discard((namespace, name))
        else:
            self._keys.add((namespace, name))

    def snapshot(self) -> list[ServerKey]:
        return sorted(self._keys)


def server_reconciler(kube: Kube, settings: OperatorSettings) -> ServerReconciler:
    """Render, plan and apply one server, and write its status: what the kopf handlers do."""

    async def reconcile_server(namespace: str, name: str) -> None:
        body = await asyncio.to_thread(kube.get, API_VERSION, KIND, namespace, name)
        if body is None:
            return
        server = LLMServer.from_body(body)
        result = await asyncio.to_thread(
            reconcile,
            kube,
            server,
            settings.default_images,
            None,
            settings.prometheus_url,
            settings.canary_no_data_seconds,
        )
        if result.status_patch:
            await asyncio.to_thread(kube.patch_status, namespace, name, result.status_patch)
        if result.error is not None:
            logger.warning(
                "%s/%s: reconcile failed: %s %s (tried again at the next resync)",
                namespace,
                name,
                result.error.status,
                result.error.reason,
            )
        elif result.applied:
            logger.info("%s/%s: resync applied %d objects", namespace, name, len(result.applied))

    return reconcile_server


async def resync_forever(
    registry: ServerRegistry, reconcile_server: ServerReconciler, interval: float
) -> None:
    """Every `interval` seconds, re-plan each registered server; a plan with nothing to do
    writes nothing."""
    while True:
        await asyncio.sleep(interval)
        keys = registry.snapshot()
        num_failed = 0
        for namespace, name in keys:
            try:
                await reconcile_server(namespace, name)
            except Exception:
                # One server's failure (the API briefly away, a conflict) must not stop the rest.
                logger.exception("%s/%s: resync failed", namespace, name)
                num_failed += 1
        logger.info("%s: %d servers, %d failed", RESYNC_DONE, len(keys), num_failed)
