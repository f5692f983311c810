"""Memory-aware scale-down: the least-loaded pod goes first.

When the autoscaler lowers the count, the ReplicaSet picks which pods to delete: pods not yet
scheduled, pending or not ready first (a pod still starting is never kept in place of one that
serves), then the lowest `controller.kubernetes.io/pod-deletion-cost`. Under spec.autoscaling the
operator keeps that cost on each ready pod equal to its requests in flight (running + waiting:
both are in the engine, and its drain must finish them; the most over the last 30 s), read from
the Prometheus that scrapes the pods (`PAGEKEEPER_PROMETHEUS_URL`), every
`PAGEKEEPER_DELETION_COST_SECONDS`. A pod is patched only when its cost changed. A pod Prometheus
has no series for keeps the cost it has (none, for a pod not yet scraped: the ReplicaSet reads
that as 0), and with Prometheus unreachable no cost is written: the engine exports its gauges
from its start, so a missing series means missing data, not an idle pod, and a busy pod must
not become the first to go because Prometheus was away. The engine drains on SIGTERM, so even
the pod that goes loses no request; the cost makes it the one with the least to finish.

`plan_deletion_costs` is pure; `keep_deletion_costs` is the loop around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.adapters.prometheus import PrometheusError, query_by
from pagekeeper_operator.controllers.resync import ServerRegistry
from pagekeeper_operator.faultpoints import FaultPoint, reached
from pagekeeper_operator.render.meta import SERVER_LABEL

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# A pod's load is the most it held over this window, so a pod between two requests at the moment
# the ReplicaSet chooses does not look idle, and the costs do not flicker with every request.
IN_FLIGHT_WINDOW = "30s"
logger = logging.getLogger(__name__)


def in_flight_query(namespace: str, server: str) -> str:
    """Requests in flight per pod of one server: the most each series held over the window,
    summed by pod (running and waiting)."""
    selector = f'{{namespace="{namespace}",llmserver="{server}"}}'
    # One term per series: a function over both names at once would drop the name and leave
    # two series with one label set, which Prometheus refuses.
    terms = (
        f"sum by (pod) (max_over_time(vllm:num_requests_{state}{selector}[{IN_FLIGHT_WINDOW}]))"
        for state in ("running", "waiting")
    )
    return " + ".join(terms)


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def plan_deletion_costs(
    pods: Sequence[Mapping[str, Any]], in_flight: Mapping[str, float]
) -> dict[str, str]:
    """Pod name -> the cost to write, for each ready, running pod with a series whose cost is
    not current (a pod without one keeps its cost: see the module docstring)."""
    changes = {}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if metadata.get("deletionTimestamp") is not None or not _is_ready(pod):
            continue
        name = str(metadata.get("name", ""))
        if name not in in_flight:
            continue
        cost = str(round(in_flight[name]))
        if (metadata.get("annotations") or {}).get(DELETION_COST_ANNOTATION) != cost:
            changes[name] = cost
    return changes


def update_deletion_costs(kube: Kube, prometheus_url: str, namespace: str, name: str) -> int:
    """One round for one server; the number of pods patched."""
    in_flight = query_by(prometheus_url, in_flight_query(namespace, name), "pod")
    pods = kube.list("v1", "Pod", namespace, f"{SERVER_LABEL}={name}")
    changes = plan_deletion_costs(pods, in_flight)
    if changes:
        reached(FaultPoint.DELETION_COSTS_PLANNED)
    for pod, cost in changes.items():
        kube.annotate_pod(namespace, pod, {DELETION_COST_ANNOTATION: cost})
        reached(FaultPoint.DELETION_COST_WRITTEN)
    return len(changes)


async def keep_deletion_costs(
    registry: ServerRegistry, kube: Kube, prometheus_url: str, interval: float
) -> None:
    """Every `interval` seconds, bring the costs of the pods of each server in `registry` (the
    autoscaled ones) up to date."""
    while True:
        await asyncio.sleep(interval)
        for namespace, name in registry.snapshot():
            try:
                num = await asyncio.to_thread(
                    update_deletion_costs, kube, prometheus_url, namespace, name
                )
            except PrometheusError as exc:
                logger.warning("%s/%s: pod-deletion costs not updated: %s", namespace, name, exc)
                continue
            except Exception:
                # One server's failure (the API briefly away) must not stop the others.
                logger.exception("%s/%s: pod-deletion costs not updated", namespace, name)
                continue
            if num:
                logger.info("%s/%s: pod-deletion costs of %d pods updated", namespace, name, num)
