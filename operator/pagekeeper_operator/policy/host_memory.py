"""The pod's host memory from its server (pure): the plan's inputs (`pagekeeper_memplan.host`),
the memory request and limit the pod gets, and the candidate node that can hold the most.

The pod's memory request and limit follow the plan where the spec leaves them and the policy
pins host memory (the KV tier, swap space or CPU weight offload): both are the plan's total, so
the scheduler places the pod where the pinned memory fits, and the container's limit is the one
the host-memory alert measures against. A policy that pins nothing leaves them as the spec has
them: the rest of the plan is an estimate of the processes' own memory, which alone should not
put a limit on a pod that runs today without one. A spec that sets one of them keeps it; the
other follows (a request never above the limit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagekeeper_memplan.host import HostInputs, HostPlan, HostVerdict, judge_host, plan_host
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import GIB, MemoryPolicy
from pagekeeper_operator.api.types import quantity_value

MiB = 1 << 20
NUM_FRONT_ENDS = 1  # the paged engine's --api-server-count, which the operator leaves at 1


def shm_size(server: LLMServer) -> str:
    """/dev/shm's size: as given, else 1Gi per GPU (at least 1Gi). It carries NCCL's buffers
    between the ranks and counts against the pod's memory limit."""
    given = server.spec.resources.shared_memory
    return given if given is not None else f"{max(1, server.spec.num_gpus)}Gi"


def host_inputs(server: LLMServer, policy: MemoryPolicy) -> HostInputs:
    """The host plan's inputs from a server and its effective policy."""
    tier = policy.kv_offload
    return HostInputs(
        tp=server.spec.parallelism.tensor,
        num_front_ends=NUM_FRONT_ENDS,
        kv_offload_bytes=0 if tier is None else tier.size_bytes,
        swap_bytes_per_rank=int(policy.swap_space_gib * GIB),
        cpu_offload_bytes_per_gpu=int(policy.weight_policy.cpu_offload_gib * GIB),
        shared_memory_bytes=int(quantity_value(shm_size(server))),
    )


@dataclass(frozen=True)
class PodMemory:
    """The engine container's memory request and limit in bytes (None: none set)."""

    request: int | None
    limit: int | None
    is_planned: bool  # whether the plan set either of them


def _bytes(text: str | None) -> int | None:
    return None if text is None else int(quantity_value(text))


def pod_memory(server: LLMServer, plan: HostPlan) -> PodMemory:
    """The container's memory request and limit: the spec's, else the plan's (module
    docstring)."""
    given = server.spec.resources
    request, limit = _bytes(given.requests.memory), _bytes(given.limits.memory)
    if plan.pinned == 0 or (request is not None and limit is not None):
        return PodMemory(request, limit, False)
    total = -(-plan.total // MiB) * MiB  # whole MiB, rounded up
    if limit is None:
        limit = max(total, request or 0)
    if request is None:
        request = min(total, limit)
    return PodMemory(request, limit, True)


def memory_quantities(server: LLMServer, policy: MemoryPolicy) -> dict[str, str]:
    """{"requests"|"limits": quantity} the plan adds to the container's resources."""
    memory = pod_memory(server, plan_host(host_inputs(server, policy)))
    if not memory.is_planned:
        return {}
    given = server.spec.resources
    added = {}
    if given.requests.memory is None and memory.request is not None:
        added["requests"] = _quantity(memory.request)
    if given.limits.memory is None and memory.limit is not None:
        added["limits"] = _quantity(memory.limit)
    return added


def _quantity(num_bytes: int) -> str:
    """Whole MiB in the API server's canonical form (the largest binary suffix that keeps an
    integer: 50176Mi is written 49Gi), so what is rendered is what `kubectl get` shows."""
    mib = num_bytes // MiB
    for suffix, per in (("Ti", 1 << 20), ("Gi", 1 << 10)):
        if mib % per == 0:
            return f"{mib // per}{suffix}"
    return f"{mib}Mi"


def most_allocatable(nodes: Sequence[Mapping[str, Any]]) -> tuple[int, str] | None:
    """The largest `status.allocatable.memory` among `nodes` (the candidates), and its node."""
    found = []
    for node in nodes:
        text = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
        if text is None:
            continue
        try:
            memory = int(quantity_value(str(text)))
        except ValueError:
            continue  # the kubelet writes a quantity; nothing else is worth a refusal
        found.append((memory, str((node.get("metadata") or {}).get("name", ""))))
    return max(found) if found else None


def judge_pod(
    server: LLMServer, policy: MemoryPolicy, nodes: Sequence[Mapping[str, Any]] | None
) -> tuple[HostPlan, PodMemory, tuple[int, str] | None, HostVerdict]:
    """The host plan, the pod's memory, the candidate node that holds the most, and whether
    the pod fits its limit and that node."""
    plan = plan_host(host_inputs(server, policy))
    memory = pod_memory(server, plan)
    allocatable = most_allocatable(nodes or [])
    verdict = judge_host(
        plan, request=memory.request or 0, limit=memory.limit, allocatable=allocatable
    )
    return plan, memory, allocatable, verdict
