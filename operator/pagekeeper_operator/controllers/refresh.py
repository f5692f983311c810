"""Status from an observed Deployment, with no applies: what the Deployment and pod handlers
write between reconciles (`refresh_status`). It describes the generation last reconciled and
never races a reconcile's newer write (the patch is made at the resource version read)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.api.autoscaling import AutoscalingStatus
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render.autoscaler import HPA_API_VERSION, HPA_KIND
from pagekeeper_operator.rollout.autoscaling import autoscaling_status
from pagekeeper_operator.status.conditions import compute_status
from pagekeeper_operator.status.patch import status_patch
from pagekeeper_operator.timestamps import format_time, utc_now

logger = logging.getLogger(__name__)


def refresh_status(
    kube: Kube,
    server: LLMServer,
    deployment: Mapping[str, Any] | None,
    now: str | None = None,
    *,
    resource_version: str | None,
) -> dict[str, Any]:
    """Write status from an observed Deployment (no applies); returns the patch written, {}
    when nothing changed or a newer write came first.

    Status keeps describing the generation last reconciled: a Deployment event that arrives
    before a newer spec's reconcile (an operator starting after a change made while it was
    down) must not report that spec as observed and Ready on the old pods. The patch is made
    at `resource_version`, the server as read: a reconcile that wrote status since (a new
    PolicyFits, say) wins, and the next event or resync refreshes from it, so a refresh never
    puts back conditions that an older read held.
    """
    reconciled = server.status.observed_generation
    if not reconciled:
        return {}  # nothing reconciled yet (the CRD's default is 0): the first reconcile writes
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
    autoscaling = _refresh_autoscaling(kube, server)
    status = compute_status(
        server, deployment, now or format_time(utc_now()), apply_error, autoscaling
    )
    patch = status_patch(server, status)
    if not patch:
        return {}
    meta = server.metadata
    if not kube.patch_status(meta.namespace, meta.name, patch, resource_version):
        logger.debug("%s/%s: status changed since it was read; not refreshed", meta.namespace,
                     meta.name)  # fmt: skip
        return {}
    return patch


def _refresh_autoscaling(kube: Kube, server: LLMServer) -> AutoscalingStatus | None:
    """status.autoscaling again from the autoscaler the last reconcile recorded."""
    previous = server.status.autoscaling
    if previous is None or not server.spec.is_autoscaled:
        return previous if server.spec.is_autoscaled else None
    hpa = kube.get(HPA_API_VERSION, HPA_KIND, server.metadata.namespace, previous.name)
    uses_keda = previous.kind == "ScaledObject"
    return autoscaling_status(server, hpa, uses_keda, previous, server.status.desired_replicas)
