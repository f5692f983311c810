"""What remediation needs of Kubernetes: `ClusterPort` and the values it passes.

The loop (`remediator`), the pod age loop and the OOM response speak only this protocol;
`actions` implements it over `adapters/kube`, the tests over an in-memory cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.remediation.decide import PodState, ServerState

EventType = Literal["Normal", "Warning"]


class EvictionOutcome(StrEnum):
    EVICTED = "evicted"
    PDB_BLOCKED = "pdb-blocked"
    POD_GONE = "pod-gone"
    FAILED = "failed"


@dataclass(frozen=True)
class ServerInfo:
    """An LLMServer with its pods and its recorded remediation history."""

    state: ServerState
    history: tuple[RemediationRecord, ...]


class ClusterPort(Protocol):
    """The Kubernetes operations remediation needs."""

    async def read_pod(self, namespace: str, name: str) -> PodState | None: ...

    async def read_server(self, namespace: str, name: str) -> ServerInfo | None: ...

    async def evict(self, namespace: str, pod: str) -> tuple[EvictionOutcome, str]: ...

    async def emit_event(
        self, namespace: str, server: str, type_: EventType, reason: str, message: str
    ) -> None: ...

    async def append_history(
        self, namespace: str, server: str, record: RemediationRecord, limit: int
    ) -> None:
        """Append `record`, or put it in place of the open eviction intent of its firing."""

    async def drop_intent(self, namespace: str, server: str, record: RemediationRecord) -> None:
        """Remove the open eviction intent of `record`'s firing."""
