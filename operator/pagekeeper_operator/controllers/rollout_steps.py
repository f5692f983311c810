"""The reconcile's rollout steps over the cluster: the canary's Deployments (`rollout.canary`)
and its outcome written before they move, and the replicas an autoscaler takes over
(`rollout.autoscaling`). Each returns what it did; `reconcile` records the failures."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.adapters.plan import ObjectKey
from pagekeeper_operator.api.autoscaling import AutoscalingStatus
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.faultpoints import FaultPoint, reached
from pagekeeper_operator.render import ClusterFeatures
from pagekeeper_operator.render.autoscaler import HPA_API_VERSION, HPA_KIND, autoscaler_hpa_name
from pagekeeper_operator.render.meta import SERVER_LABEL
from pagekeeper_operator.rollout.autoscaling import HANDOVER_MANAGER, autoscaling_status, handover
from pagekeeper_operator.rollout.canary import (
    CANARY_LABEL,
    CanaryEvent,
    canary_name,
    canary_pod,
    decide_canary,
    shape_deployments,
    template_identity,
)
from pagekeeper_operator.rollout.canary_data import observe_canary_data
from pagekeeper_operator.status.patch import status_patch
from pagekeeper_operator.tuning.step import trial_canary_spec

logger = logging.getLogger(__name__)


def record_canary_outcome(kube: Kube, stored: LLMServer, server: LLMServer) -> ApiException | None:
    """Write status.canary's outcome before the Deployments move; the write's failure, if any.
    Once the canary pods are deleted their failure can no longer be read from them, and a
    Deployment that already runs the new template looks like one with no canary to judge: an
    operator killed between the two would analyze a failed canary again (and could promote it)
    or leave it Analyzing for good. Written first, a restarted operator reads the outcome back
    and finishes the step."""
    meta = server.metadata
    update = stored.status.model_copy(update={"canary": server.status.canary})
    patch = status_patch(stored, update)
    try:
        kube.patch_status(meta.namespace, meta.name, patch)
    except ApiException as exc:
        logger.warning("%s/%s: recording the canary's outcome failed: %s %s", meta.namespace,
                       meta.name, exc.status, exc.reason)  # fmt: skip
        return exc
    return None


def hand_over(
    kube: Kube, server: LLMServer, observed: dict[ObjectKey, Any]
) -> tuple[ApiException | None, str | None]:
    """Keep the Deployment's count while our apply stops owning it (`autoscaling`); a failure
    and its error text. A conflict means the autoscaler changed the count meanwhile: the next
    reconcile looks again."""
    key = ("apps/v1", "Deployment", server.metadata.name)
    manifest = handover(server, observed.get(key), kube.field_manager)
    if manifest is None:
        return None, None
    try:
        observed[key] = kube.apply(manifest, field_manager=HANDOVER_MANAGER, force=False)
        reached(FaultPoint.AUTOSCALING_HANDED_OVER)
    except ApiException as exc:
        text = f"handing Deployment/{key[2]} replicas to the autoscaler failed ({exc.status})"
        logger.warning("%s/%s: %s", server.metadata.namespace, server.metadata.name, text)
        return exc, text
    logger.info(
        "%s/%s: handed Deployment/%s replicas (%d) to the autoscaler",
        server.metadata.namespace,
        server.metadata.name,
        key[2],
        manifest["spec"]["replicas"],
    )
    return None, None


def observed_autoscaling(
    kube: Kube, server: LLMServer, features: ClusterFeatures, observed: Mapping[ObjectKey, Any]
) -> AutoscalingStatus | None:
    """status.autoscaling from the HorizontalPodAutoscaler that scales the Deployment."""
    if not server.spec.is_autoscaled:
        return None
    name = server.metadata.name
    hpa = observed.get((HPA_API_VERSION, HPA_KIND, name))
    if features.uses_keda:
        hpa_name = autoscaler_hpa_name(server, uses_keda=True)
        hpa = kube.get(HPA_API_VERSION, HPA_KIND, server.metadata.namespace, hpa_name)
    status = server.status
    return autoscaling_status(
        server, hpa, features.uses_keda, status.autoscaling, status.desired_replicas
    )


def with_canary(
    kube: Kube,
    server: LLMServer,
    desired: list[dict[str, Any]],
    now: datetime,
    watch: tuple[str | None, int],
) -> tuple[list[dict[str, Any]], LLMServer, CanaryEvent | None]:
    """The objects to apply under spec.rollout.canary, the server with its new canary status,
    and the Event to post (see `canary`); `watch` is the Prometheus URL that has the canary
    pods' data and how long the canary may go without it."""
    namespace, name = server.metadata.namespace, server.metadata.name
    rendered = next(m for m in desired if m["kind"] == "Deployment")
    running = kube.get("apps/v1", "Deployment", namespace, name)
    stable_template = None if running is None else running["spec"]["template"]
    spec = server.spec
    # Under spec.autoscaling the count is the autoscaler's: the canary comes beside it.
    replicas = spec.replicas
    if spec.is_autoscaled and running is not None:
        replicas = int(running["spec"].get("replicas") or 0)
    pods = []
    if spec.rollout.canary.enabled or server.status.canary is not None:
        selector = f"{SERVER_LABEL}={name},{CANARY_LABEL}=true"
        pods = [canary_pod(p) for p in kube.list("v1", "Pod", namespace, selector)]
    url, no_data_seconds = watch
    data = None
    analysis = server.status.canary
    if url is not None and analysis is not None and analysis.phase == "Analyzing":
        data = observe_canary_data(url, namespace, name, f"{canary_name(name)}-")
    plan = decide_canary(
        trial_canary_spec(server),
        replicas=replicas,
        max_surge=spec.rollout.max_surge,
        candidate=template_identity(rendered["spec"]["template"]),
        stable=None if stable_template is None else template_identity(stable_template),
        previous=server.status.canary,
        pods=pods,
        history=server.status.remediation_history,
        server_name=name,
        now=now,
        data=data,
        no_data_seconds=no_data_seconds,
    )
    status = server.status.model_copy(update={"canary": plan.status})
    server = server.model_copy(update={"status": status})
    shaped = shape_deployments(desired, plan, stable_template, owns_replicas=not spec.is_autoscaled)
    return shaped, server, plan.event
