"""Remediation's `ClusterPort` over the operator's Kubernetes adapter (`kube.Kube`): pods and
servers read, evictions, Events, and history appended to status.

Evictions go through the Eviction API (policy/v1), so PodDisruptionBudgets hold: a 429 means
a budget forbids it now and is retried later, never turned into a delete. The adapter blocks,
so every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from pagekeeper_operator.adapters.kube import Kube, StatusChange
from pagekeeper_operator.api.llmserver import API_VERSION, KIND, LLMServer
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.failures import UnreadableDataError
from pagekeeper_operator.remediation.decide import PodState, ServerState
from pagekeeper_operator.remediation.port import EventType, EvictionOutcome, ServerInfo
from pagekeeper_operator.remediation.state import EVICT_INTENT
from pagekeeper_operator.render.meta import SERVER_LABEL, is_controlled_by
from pagekeeper_operator.timestamps import format_time, parse_or, utc_now

logger = logging.getLogger(__name__)
COMPONENT = "pagekeeper-operator"


def is_server_pod(pod: Mapping[str, Any]) -> bool:
    """A pod belongs to a server when it carries the server label and a ReplicaSet controls it
    (a hand-made pod with a copied label is not the Deployment's to replace)."""
    labels = pod.get("metadata", {}).get("labels") or {}
    return SERVER_LABEL in labels and is_controlled_by(pod, kind="ReplicaSet")


def pod_state(pod: Mapping[str, Any]) -> PodState:
    metadata = pod.get("metadata", {})
    conditions = (pod.get("status") or {}).get("conditions") or []
    return PodState(
        name=str(metadata.get("name", "")),
        namespace=str(metadata.get("namespace", "")),
        server=metadata["labels"][SERVER_LABEL] if is_server_pod(pod) else None,
        is_ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        is_terminating=metadata.get("deletionTimestamp") is not None,
    )


def _is_intent_of(entry: Mapping[str, Any], record: RemediationRecord) -> bool:
    """Whether `entry` is the open eviction intent of the firing `record` is about."""
    return (
        entry.get("action") == "evict"
        and entry.get("outcome") == EVICT_INTENT
        and entry.get("pod") == record.pod
        and entry.get("fingerprint") == record.fingerprint
        and parse_or(entry.get("alertStartsAt"), None) == record.alert_starts_at
    )


def bounded_history(
    history: Sequence[dict[str, Any]], record: RemediationRecord, limit: int
) -> list[dict[str, Any]]:
    """History with `record` appended, or in place of the open eviction intent of the same
    firing (which it settles), keeping the `limit` most recent, oldest first."""
    entry = record.model_dump(by_alias=True, exclude_none=True)
    entries = [entry if _is_intent_of(e, record) else dict(e) for e in history]
    if not any(_is_intent_of(e, record) for e in history):
        entries.append(entry)
    return entries[-limit:]


def without_intent(
    history: Sequence[dict[str, Any]], record: RemediationRecord
) -> list[dict[str, Any]]:
    """History without the open eviction intent of the firing `record` is about."""
    return [dict(e) for e in history if not _is_intent_of(e, record)]


def server_info(
    body: dict[str, Any], pods: Sequence[PodState], deployment_replicas: int | None = None
) -> ServerInfo:
    """ServerInfo from an LLMServer object as the API returns it. Under spec.autoscaling the
    desired count is the Deployment's (`deployment_replicas`, the autoscaler's), not
    spec.replicas. An object its models refuse (stored under an older schema) is an
    UnreadableDataError: until the object changes, every retry reads the same."""
    try:
        server = LLMServer.from_body(body)
    except ValidationError as error:
        metadata = body.get("metadata") or {}
        name = f"{metadata.get('namespace')}/{metadata.get('name')}"
        raise UnreadableDataError(f"LLMServer {name} cannot be read: {error}") from error
    num_desired = server.spec.replicas
    if server.spec.is_autoscaled and deployment_replicas is not None:
        num_desired = deployment_replicas
    state = ServerState(
        namespace=server.metadata.namespace,
        name=server.metadata.name,
        remediation=server.spec.remediation,
        num_desired=num_desired,
        pods=tuple(p for p in pods if p.server == server.metadata.name),
        runtime=server.spec.runtime,
        has_plugin=server.spec.has_vllm_plugin,
    )
    return ServerInfo(state=state, history=tuple(server.status.remediation_history))


def event(
    namespace: str, server: str, uid: str | None, type_: EventType, reason: str, message: str
) -> dict[str, Any]:
    """A core/v1 Event about an LLMServer."""
    now = format_time(utc_now())
    involved = {"apiVersion": API_VERSION, "kind": KIND, "name": server, "namespace": namespace}
    if uid:
        involved["uid"] = uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{server}.", "namespace": namespace},
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message,
        "action": "Remediate",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class KubeClusterPort:
    """`ClusterPort` over the Kubernetes API."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._uids: dict[tuple[str, str], str] = {}

    async def read_pod(self, namespace: str, name: str) -> PodState | None:
        pod = await asyncio.to_thread(self.kube.get, "v1", "Pod", namespace, name)
        return None if pod is None else pod_state(pod)

    async def read_server(self, namespace: str, name: str) -> ServerInfo | None:
        body = await asyncio.to_thread(self.kube.get, API_VERSION, KIND, namespace, name)
        if body is None:
            return None
        self._uids[(namespace, name)] = body["metadata"].get("uid", "")
        selector = f"{SERVER_LABEL}={name}"
        pods = await asyncio.to_thread(self.kube.list, "v1", "Pod", namespace, selector)
        replicas = None
        if (body.get("spec") or {}).get("autoscaling") is not None:
            deployment = await asyncio.to_thread(
                self.kube.get, "apps/v1", "Deployment", namespace, name
            )
            replicas = None if deployment is None else deployment["spec"].get("replicas")
        return server_info(body, [pod_state(pod) for pod in pods], replicas)

    async def evict(self, namespace: str, pod: str) -> tuple[EvictionOutcome, str]:
        try:
            await asyncio.to_thread(self.kube.evict, namespace, pod)
        except ApiException as error:
            detail = f"eviction of {namespace}/{pod} refused ({error.status}): {error.reason}"
            if error.status == 429:
                return EvictionOutcome.PDB_BLOCKED, f"{detail}; a PodDisruptionBudget forbids it"
            if error.status == 404:
                return EvictionOutcome.POD_GONE, f"pod {namespace}/{pod} no longer exists"
            logger.error("%s: %s", detail, error.body)
            return EvictionOutcome.FAILED, detail
        return EvictionOutcome.EVICTED, f"evicted {namespace}/{pod}"

    async def emit_event(
        self, namespace: str, server: str, type_: EventType, reason: str, message: str
    ) -> None:
        uid = self._uids.get((namespace, server))
        try:
            body = event(namespace, server, uid, type_, reason, message)
            await asyncio.to_thread(self.kube.create_event, body)
        except ApiException as error:
            # An Event is best effort; the history in status is the record.
            logger.error("could not post Event %s for %s/%s: %s", reason, namespace, server, error)

    async def update_server_status(
        self, namespace: str, name: str, change: StatusChange
    ) -> dict[str, Any] | None:
        """`Kube.update_status`: the object the written patch was computed from, or None."""
        body = await asyncio.to_thread(self.kube.update_status, namespace, name, change)
        if body is not None:
            self._uids[(namespace, name)] = body["metadata"].get("uid", "")
        return body

    async def append_history(
        self, namespace: str, server: str, record: RemediationRecord, limit: int
    ) -> None:
        """Append under optimistic concurrency: a concurrent status write means read again."""

        def change(body: dict[str, Any]) -> dict[str, Any]:
            history = (body.get("status") or {}).get("remediationHistory", [])
            status: dict[str, Any] = {"remediationHistory": bounded_history(history, record, limit)}
            if record.action != "skip" and record.outcome != EVICT_INTENT:
                status["lastRemediation"] = format_time(record.time)
            return status

        await self.update_server_status(namespace, server, change)

    async def drop_intent(self, namespace: str, server: str, record: RemediationRecord) -> None:
        """Remove the open eviction intent of `record`'s firing (an eviction refused again,
        whose refusal is already recorded)."""

        def change(body: dict[str, Any]) -> dict[str, Any] | None:
            history = (body.get("status") or {}).get("remediationHistory", [])
            kept = without_intent(history, record)
            return None if len(kept) == len(history) else {"remediationHistory": kept}

        await self.update_server_status(namespace, server, change)
