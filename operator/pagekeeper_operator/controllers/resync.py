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

from pydantic import ValidationError

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.api.llmserver import API_VERSION, KIND, LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
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


# A resync's status write made stale by another writer is redone from a fresh read this many
# times in all; past that the next round writes it.
STATUS_WRITE_ATTEMPTS = 3


def server_reconciler(kube: Kube, settings: OperatorSettings) -> ServerReconciler:
    """Render, plan and apply one server, and write its status: what the kopf handlers do.

    The status write is made at the resourceVersion the server was read at. A resync reads
    long before it writes (it applies and waits on the API in between), and the patch carries
    whole fields (the conditions list): written blind, it would put back what that older read
    held over a newer write by the kopf handlers or remediation. On a conflict the server is
    read and reconciled again."""

    async def reconcile_server(namespace: str, name: str) -> None:
        for _ in range(STATUS_WRITE_ATTEMPTS):
            if await _reconcile_once(namespace, name):
                return
        logger.info(
            "%s/%s: status kept changing while it was reconciled; written at the next resync",
            namespace,
            name,
        )

    async def _reconcile_once(namespace: str, name: str) -> bool:
        """False: the status write lost to a newer one (nothing else went wrong)."""
        body = await asyncio.to_thread(kube.get, API_VERSION, KIND, namespace, name)
        if body is None:
            return True
        try:
            server = LLMServer.from_body(body)
        except ValidationError as exc:
            # The kopf handler says why in Stalled (Unreadable); nothing to re-plan until then.
            logger.warning("%s/%s: not re-planned, it does not validate: %s", namespace, name, exc)
            return True
        result = await asyncio.to_thread(
            reconcile,
            kube,
            server,
            settings.default_images,
            None,
            settings.prometheus_url,
            settings.canary_no_data_seconds,
        )
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
        if not result.status_patch:
            return True
        version = body.get("metadata", {}).get("resourceVersion")
        return await asyncio.to_thread(
            kube.patch_status, namespace, name, result.status_patch, version
        )

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
