"""The rules across sections of `LLMServer.spec`: CEL on the spec (`SPEC_RULES`, in the CRD's
order); `llmserver.spec_violation` makes the same checks, so the models refuse what the API
server does.

A field one runtime cannot honour, a floor above the value it bounds, a grace period shorter
than the drain, a canary as large as the fleet. Rules within one section live beside it
(`policy`, `gateway`, `tuning_bounds`); those it shares with the spec are listed here too.
"""

from __future__ import annotations

from pagekeeper_memplan.defaults import DEFAULT_GPU_MEMORY_UTILIZATION
from pagekeeper_operator.api.gateway import PREFIX_CACHE_RULE
from pagekeeper_operator.api.policy import KV_OFFLOAD_BACKEND_RULE
from pagekeeper_operator.api.runtime import (
    RUNTIMES,
    TRIGGERS,
    Runtime,
    missing_series,
    unfed_message,
)
from pagekeeper_operator.api.tuning import APPLY_RULE, BOUNDS_RULES
from pagekeeper_operator.api.types import cel

SWAP_RULE = cel(
    "self.runtime == 'pagekeeper' || self.memoryPolicy.swapSpaceGiB == 0.0",
    "spec.memoryPolicy.swapSpaceGiB must be 0 when spec.runtime is vllm "
    "(only the pagekeeper runtime swaps KV blocks to CPU memory)",
    ".memoryPolicy.swapSpaceGiB",
)
BLOCK_SIZE_RULE = cel(
    "self.runtime == 'pagekeeper' || self.memoryPolicy.blockSize != 8",
    "spec.memoryPolicy.blockSize must be 16 or 32 when spec.runtime is vllm "
    "(vLLM's CUDA attention backends need a multiple of 16)",
    ".memoryPolicy.blockSize",
)
ADAPTIVE_FLOOR_RULE = cel(
    "!self.remediation.adaptive.enabled || has(self.memoryPolicy.kvCacheMemory)"
    " || self.remediation.adaptive.minGpuMemoryUtilization"
    " <= (has(self.memoryPolicy.gpuMemoryUtilization)"
    f" ? self.memoryPolicy.gpuMemoryUtilization : {DEFAULT_GPU_MEMORY_UTILIZATION})",
    "spec.remediation.adaptive.minGpuMemoryUtilization must be <= "
    f"spec.memoryPolicy.gpuMemoryUtilization ({DEFAULT_GPU_MEMORY_UTILIZATION} when unset; the "
    "floor of a step-down cannot be above the utilization it steps down from)",
    ".remediation.adaptive.minGpuMemoryUtilization",
)
OFFLOAD_MEMORY_RULE = cel(
    "!has(self.memoryPolicy.weights) || !has(self.resources.requests.memory)"
    " || quantity(string(self.resources.requests.memory)).asApproximateFloat()"
    " >= self.memoryPolicy.weights.cpuOffloadGiB * 1073741824.0 * double(self.parallelism.tensor)",
    "spec.resources.requests.memory must cover spec.memoryPolicy.weights.cpuOffloadGiB times "
    "spec.parallelism.tensor (the offloaded weights live in the pod's pinned host memory, per "
    "GPU); raise the request or offload less",
    ".memoryPolicy.weights.cpuOffloadGiB",
)
DRAIN_RULE = cel(
    "self.shutdownGracePeriodSeconds >= self.remediation.drainTimeoutSeconds",
    "spec.shutdownGracePeriodSeconds must be >= spec.remediation.drainTimeoutSeconds (a "
    "shorter grace period lets the kubelet kill a pod in the middle of its drain)",
    ".shutdownGracePeriodSeconds",
)


def trigger_rule(runtime: Runtime, key: str, reason: str) -> dict[str, str]:
    enabled = f"self.remediation.triggers.{key}.enabled"
    return cel(
        f"self.runtime != '{runtime}' || !has({enabled}) || !{enabled}",
        f"spec.remediation.triggers.{key}.enabled must not be true when spec.runtime is "
        f"{runtime} ({reason}, so its alert could never fire; leave it unset)",
        f".remediation.triggers.{key}.enabled",
    )


# A trigger switched on explicitly for a runtime that does not export what its alert reads.
TRIGGER_RULES: tuple[dict[str, str], ...] = tuple(
    trigger_rule(runtime, trigger.key, unfed_message(runtime, trigger))
    for runtime in RUNTIMES
    for trigger in TRIGGERS
    if missing_series(runtime, trigger)
)
GPU_RULE = cel(
    "!has(self.resources.gpus) || self.resources.gpus == self.parallelism.tensor"
    " || (self.resources.gpus == 0 && self.parallelism.tensor == 1)",
    "spec.resources.gpus must equal spec.parallelism.tensor (one GPU per tensor-parallel rank), "
    "or be 0 (the CPU) with tensor 1; leave it unset to derive it from spec.parallelism.tensor",
    ".resources.gpus",
)
PYTHONPATH_RULE = cel(
    "self.runtime != 'vllm' || !has(self.podTemplate) || !has(self.podTemplate.env)"
    " || self.podTemplate.env.all(e, e.name != 'PYTHONPATH' || !has(e.valueFrom))",
    "spec.podTemplate.env must give PYTHONPATH as a value, not valueFrom, when spec.runtime is "
    "vllm (the operator puts pagekeeper's vLLM plugin in front of it)",
    ".podTemplate.env",
)
CANARY_RULE = cel(
    "!self.rollout.canary.enabled || has(self.autoscaling)"
    " || self.rollout.canary.replicas < self.replicas",
    "spec.rollout.canary.replicas must be below spec.replicas (the canary tests a change on "
    "some of the pods, not all)",
    ".rollout.canary.replicas",
)
CANARY_CAPACITY_RULE = cel(
    "!self.rollout.canary.enabled || has(self.autoscaling) || self.rollout.maxSurge > 0"
    " || self.rollout.canary.replicas <= self.rollout.maxUnavailable",
    "spec.rollout.canary.replicas must be at most spec.rollout.maxUnavailable when "
    "spec.rollout.maxSurge is 0 (the canary's start takes that many current pods out at once)",
    ".rollout.canary.replicas",
)
AUTOSCALING_CANARY_RULE = cel(
    "!self.rollout.canary.enabled || !has(self.autoscaling)"
    " || self.rollout.canary.replicas < self.autoscaling.minReplicas",
    "spec.rollout.canary.replicas must be below spec.autoscaling.minReplicas (the canary tests a "
    "change on some of the pods, not all, however few the autoscaler keeps)",
    ".rollout.canary.replicas",
)
SPEC_RULES: tuple[dict[str, str], ...] = (
    SWAP_RULE,
    KV_OFFLOAD_BACKEND_RULE,
    BLOCK_SIZE_RULE,
    ADAPTIVE_FLOOR_RULE,
    OFFLOAD_MEMORY_RULE,
    DRAIN_RULE,
    GPU_RULE,
    CANARY_RULE,
    CANARY_CAPACITY_RULE,
    AUTOSCALING_CANARY_RULE,
    PYTHONPATH_RULE,
    PREFIX_CACHE_RULE,
    *TRIGGER_RULES,
    *BOUNDS_RULES,
    APPLY_RULE,
)
