"""The memory policy pods actually run with, and its hash.

`spec.memoryPolicy` is what the user asked for; `status.effectiveMemoryPolicy` is what the pods
run with. The adaptive logic may step the effective policy down after out-of-memory crashes
(writing status only, so GitOps tools see no drift). `status.specMemoryPolicyHash` records
which spec the effective policy was derived from: when the user edits the policy, the stepped-down
values are dropped and the new spec applies as written.
"""

from __future__ import annotations

import hashlib
import json

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import AllocatorPolicy, MemoryPolicy

HASH_LENGTH = 16


# Fields added after servers existed: left out of the hash while unset, so those servers keep
# their hash (and their pods) across an operator upgrade.
_HASHED_WHEN_SET = ("kvCacheMemory", "weights")


def memory_policy_hash(policy: MemoryPolicy) -> str:
    """A short, stable hash of a policy's values (key order and defaults do not matter; an
    unset gpuMemoryUtilization hashes as the 0.9 it means)."""
    values = resolve_budget(policy).model_dump(by_alias=True, mode="json")
    for name in _HASHED_WHEN_SET:
        if values.get(name) is None:
            values.pop(name, None)
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


def resolve_budget(policy: MemoryPolicy) -> MemoryPolicy:
    """The policy with its budget spelled out: gpuMemoryUtilization 0.9 where neither it nor
    kvCacheMemory is set, so status, the step-down and `kubectl get` read the value in force."""
    utilization = policy.effective_utilization
    if utilization == policy.gpu_memory_utilization:
        return policy
    return policy.model_copy(update={"gpu_memory_utilization": utilization})


def effective_memory_policy(server: LLMServer) -> MemoryPolicy:
    """The policy to render: the stepped-down status copy while it still matches the spec."""
    status = server.status
    if (
        status.effective_memory_policy is not None
        and status.spec_memory_policy_hash == memory_policy_hash(server.spec.memory_policy)
    ):
        return resolve_budget(status.effective_memory_policy)
    return resolve_budget(server.spec.memory_policy)


def allocator_conf(allocator: AllocatorPolicy) -> str:
    """PYTORCH_CUDA_ALLOC_CONF text, e.g. `expandable_segments:True,max_split_size_mb:512`."""
    options = [f"expandable_segments:{allocator.expandable_segments}"]
    if allocator.garbage_collection_threshold is not None:
        options.append(f"garbage_collection_threshold:{allocator.garbage_collection_threshold}")
    if allocator.max_split_size_mb is not None:
        options.append(f"max_split_size_mb:{allocator.max_split_size_mb}")
    return ",".join(options)
