"""Remediation's Kubernetes I/O: read pods and servers, evict, post Events, append history.

Evictions go through the Eviction API (policy/v1), so PodDisruptionBudgets hold: a 429 means
a budget forbids it now and is retried later, never turned into a delete. The kubernetes
client is blocking, so every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import (
    ApiClient,
    CoreV1Api,
    CoreV1Event,
    CustomObjectsApi,
    V1EventSource,
    V1Eviction,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
)
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.api.llmserver import API_VERSION, GROUP, KIND, PLURAL, VERSION, LLMServer
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.decide import PodState, ServerState
from pagekeeper_operator.remediation.remediator import EventType, EvictionOutcome, ServerInfo
from pagekeeper_operator.render.meta import SERVER_LABEL

logger = logging.getLogger(__name__)
COMPONENT = "pagekeeper-operator"
MERGE_PATCH = "application/merge-patch+json"
MAX_CONFLICT_RETRIES = 5


def pod_state(pod: V1Pod) -> PodState:
    """A pod belongs to a server when it carries the server label and a ReplicaSet controls it
    (a hand-made pod with a copied label is not the Deployment's to replace)."""
    metadata = pod.metadata or V1ObjectMeta()
    labels = metadata.labels or {}
    is_controlled = any(
        ref.controller and ref.kind == "ReplicaSet" for ref in metadata.owner_references or []
    )
    conditions = (pod.status.conditions if pod.status else None) or []
    is_ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return PodState(
        name=metadata.name or "",
        namespace=metadata.namespace or "",
        server=labels.get(SERVER_LABEL) if is_controlled else None,
        is_ready=is_ready,
        is_terminating=metadata.deletion_timestamp is not None,
    )


def bounded_history(
    history: Sequence[dict[str, Any]], record: RemediationRecord, limit: int
) -> list[dict[str, Any]]:
    """History with `record` appended, keeping the `limit` most recent, oldest first."""
    entries = [*history, record.model_dump(by_alias=True, exclude_none=True)]
    return entries[-limit:]


def server_info(body: dict[str, Any], pods: Sequence[PodState]) -> ServerInfo:
    """ServerInfo from an LLMServer object as the API returns it."""
    server = LLMServer.from_body(body)
    state = ServerState(
        namespace=server.metadata.namespace,
        name=server.metadata.name,
        remediation=server.spec.remediation,
        num_desired=server.spec.replicas,
        pods=tuple(p for p in pods if p.server == server.metadata.name),
        runtime=server.spec.runtime,
    )
    return ServerInfo(state=state, history=tuple(server.status.remediation_history))


class KubeClusterPort:
    """`ClusterPort` over the Kubernetes API."""

    def __init__(self, api: ApiClient) -> None:
        self.core = CoreV1Api(api)
        self.custom = CustomObjectsApi(api)
        self._uids: dict[tuple[str, str], str] = {}
        self._instance = socket.gethostname()

    async def read_pod(self, namespace: str, name: str) -> PodState | None:
        try:
            pod = await asyncio.to_thread(self.core.read_namespaced_pod, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return pod_state(pod)

    async def read_server_object(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            body = await asyncio.to_thread(
                self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        assert isinstance(body, dict), f"LLMServer {namespace}/{name} is not an object"
        self._uids[(namespace, name)] = body["metadata"].get("uid", "")
        return body

    async def read_server(self, namespace: str, name: str) -> ServerInfo | None:
        body = await self.read_server_object(namespace, name)
        if body is None:
            return None
        pod_list = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=f"{SERVER_LABEL}={name}"
        )
        return server_info(body, [pod_state(pod) for pod in pod_list.items])

    async def evict(self, namespace: str, pod: str) -> tuple[EvictionOutcome, str]:
        eviction = V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=V1ObjectMeta(name=pod, namespace=namespace),
        )
        try:
            await asyncio.to_thread(
                self.core.create_namespaced_pod_eviction, pod, namespace, eviction
            )
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
        now = datetime.now(UTC)
        event = CoreV1Event(
            metadata=V1ObjectMeta(generate_name=f"{server}.", namespace=namespace),
            involved_object=V1ObjectReference(
                api_version=API_VERSION,
                kind=KIND,
                name=server,
                namespace=namespace,
                uid=self._uids.get((namespace, server)),
            ),
            type=type_,
            reason=reason,
            message=message,
            action="Remediate",
            source=V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT,
            reporting_instance=self._instance,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, namespace, event)
        except ApiException as error:
            # An Event is best effort; the history in status is the record.
            logger.error("could not post Event %s for %s/%s: %s", reason, namespace, server, error)

    async def patch_server_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str
    ) -> bool:
        """Merge-patch status if the object is still at `resource_version`; False on conflict."""
        patch = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            await asyncio.to_thread(
                self.custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                patch,
                _content_type=MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    async def append_history(
        self, namespace: str, server: str, record: RemediationRecord, limit: int
    ) -> None:
        """Append under optimistic concurrency: a concurrent status write means read again."""
        for _ in range(MAX_CONFLICT_RETRIES):
            body = await self.read_server_object(namespace, server)
            if body is None:
                return
            history = (body.get("status") or {}).get("remediationHistory", [])
            status: dict[str, Any] = {"remediationHistory": bounded_history(history, record, limit)}
            if record.action != "skip":
                status["lastRemediation"] = record.time
            version = body["metadata"]["resourceVersion"]
            if await self.patch_server_status(namespace, server, status, version):
                return
        raise RuntimeError(f"status of {namespace}/{server} kept changing; history not written")
