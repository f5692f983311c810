"""`LLMServer` (pagekeeper.dev/v1alpha1): one model served by GPU pods under a memory policy.

These pydantic models are the single source of the CRD (`python -m pagekeeper_operator.crdgen`):
field descriptions become `kubectl explain` text, bounds become schema, cross-field rules CEL.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from pagekeeper_memplan.defaults import DEFAULT_GPU_MEMORY_UTILIZATION
from pagekeeper_operator.api.autoscaling import AutoscalingSpec
from pagekeeper_operator.api.gateway import PREFIX_CACHE_RULE, GatewaySpec
from pagekeeper_operator.api.lifecycle import LifecycleSpec
from pagekeeper_operator.api.pod import PodTemplateOverrides
from pagekeeper_operator.api.policy import KV_OFFLOAD_BACKEND_RULE, MemoryPolicy
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.rollout import RolloutSpec
from pagekeeper_operator.api.runtime import (
    RUNTIMES,
    TRIGGERS,
    VLLM_PLUGINS_ENV,
    Runtime,
    missing_series,
    unfed_message,
    vllm_loads_plugin,
)
from pagekeeper_operator.api.status import LLMServerStatus
from pagekeeper_operator.api.tuning import APPLY_RULE, BOUNDS_RULES, TuningSpec, bounds_violation
from pagekeeper_operator.api.types import (
    ApiModel,
    cel,
    quantity_value,
    validations,
)
from pagekeeper_operator.api.workload import (
    ApiKeySpec,
    DisruptionBudgetSpec,
    ModelSource,
    ParallelismSpec,
    Resources,
    ServiceSpec,
)

GROUP = "pagekeeper.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMServer"
PLURAL = "llmservers"
SINGULAR = "llmserver"
SHORT_NAMES = ["llms"]
CATEGORIES = ["pagekeeper"]
# Validation context of an object read back from the API server (see `LLMServer.from_body`).
STORED_CONTEXT = "stored"

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


def _trigger_rule(runtime: Runtime, key: str, reason: str) -> dict[str, str]:
    enabled = f"self.remediation.triggers.{key}.enabled"
    return cel(
        f"self.runtime != '{runtime}' || !has({enabled}) || !{enabled}",
        f"spec.remediation.triggers.{key}.enabled must not be true when spec.runtime is "
        f"{runtime} ({reason}, so its alert could never fire; leave it unset)",
        f".remediation.triggers.{key}.enabled",
    )


# A trigger switched on explicitly for a runtime that does not export what its alert reads.
TRIGGER_RULES: tuple[dict[str, str], ...] = tuple(
    _trigger_rule(runtime, trigger.key, unfed_message(runtime, trigger))
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


class LLMServerSpec(ApiModel):
    """Desired state of an LLMServer."""

    model_config = ConfigDict(
        json_schema_extra=validations(
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
    )

    model: ModelSource = Field(description="The model to serve.")
    runtime: Runtime = Field(
        default="pagekeeper",
        description=(
            "Engine to run: pagekeeper (the paged engine) or vllm (an upstream vLLM image "
            "driven by the same memory policy)."
        ),
    )
    image: str | None = Field(
        default=None,
        max_length=1024,
        description="Container image; unset, the operator's default for the runtime.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="imagePullPolicy of the engine container."
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description=(
            "Number of engine pods. Not used while spec.autoscaling is set: the autoscaler owns "
            "the count (set this to the count you want before removing spec.autoscaling)."
        ),
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description=(
            "Set: an autoscaler scales the pods on their KV-cache usage and request queues "
            "(a HorizontalPodAutoscaler on prometheus-adapter's custom metrics, or a KEDA "
            "ScaledObject where KEDA is installed), and the operator never writes the "
            "Deployment's replicas. Unset (the default): spec.replicas pods."
        ),
    )
    api_key: ApiKeySpec | None = Field(
        default=None,
        description=(
            "Lock the OpenAI endpoints: clients must send Authorization: Bearer <key> on /v1/* "
            "(401 otherwise), for either runtime (--api-key, read from the Secret into the "
            "container's environment, never written into the pod spec). /health, /ready and "
            "/metrics stay open for the probes and Prometheus. Unset: no key."
        ),
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec,
        description="How the model is split over the pod's GPUs (tensor parallelism).",
    )
    memory_policy: MemoryPolicy = Field(
        default_factory=MemoryPolicy,
        description="GPU memory policy; each field becomes an engine flag.",
    )
    remediation: RemediationSpec = Field(
        default_factory=RemediationSpec,
        description="What the operator may do when a memory alert fires.",
    )
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="The Service.")
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec,
        description="The PodDisruptionBudget of the pods: rendered by the operator or your own.",
    )
    pod_template: PodTemplateOverrides = Field(
        default_factory=PodTemplateOverrides, description="Additions to the rendered pods."
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout strategy.")
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec,
        description=(
            "How routers reach the pods: an InferencePool (Gateway API Inference Extension) and "
            "KV cache events for KV-aware routers."
        ),
    )
    tuning: TuningSpec = Field(
        default_factory=TuningSpec,
        description=(
            "Self-tuning of the memory policy: recommend (the default) or try on a canary and "
            "keep better values, within bounds; never written to spec (docs/memory-policy.md)."
        ),
    )
    lifecycle: LifecycleSpec = Field(
        default_factory=LifecycleSpec,
        description="How long a pod may serve before the operator replaces it (maxPodAge).",
    )
    shutdown_grace_period_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description=(
            "Seconds running requests get to finish after the pod is told to stop "
            "(--shutdown-timeout); the pod's termination grace period adds a margin to it."
        ),
    )
    stuck_timeout_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "Seconds an engine may hold requests without making progress (a completed step; "
            "under vLLM a generated token or an answered /health) before it is ended as stuck: "
            "the pod restarts with the termination message pagekeeper-stuck, which the canary "
            "and the remediation history count (--stuck-timeout of the paged engine and of the "
            "vLLM launcher). 0 turns the watchdog off. Unset: their default, 60, which allows "
            "for a whole 32k-token prefill on a slow GPU; raise it for longer steps."
        ),
    )

    @property
    def is_autoscaled(self) -> bool:
        """Whether an autoscaler owns the replica count (spec.replicas is then not used)."""
        return self.autoscaling is not None

    @property
    def num_gpus(self) -> int:
        """GPUs per pod: as given, else one per tensor-parallel rank."""
        gpus = self.resources.gpus
        return self.parallelism.tensor if gpus is None else gpus

    @property
    def vllm_plugins(self) -> tuple[bool, str | None]:
        """(is set, value) of the VLLM_PLUGINS the user gives the container. The value is None
        when it comes from a Secret or ConfigMap, "" when set with no value."""
        setting = next((e for e in self.pod_template.env if e.name == VLLM_PLUGINS_ENV), None)
        if setting is None:
            return False, None
        return True, (None if setting.value_from is not None else setting.value or "")

    @property
    def has_vllm_plugin(self) -> bool:
        """Under runtime vllm, whether pagekeeper's plugin loads in vLLM's processes (assumed
        where VLLM_PLUGINS comes from a Secret or ConfigMap); always True for the paged engine."""
        is_set, value = self.vllm_plugins
        if self.runtime != "vllm" or not is_set or value is None:
            return True
        return vllm_loads_plugin(value)

    @model_validator(mode="after")
    def _check_cross_fields(self, info: ValidationInfo) -> LLMServerSpec:
        policy, remediation = self.memory_policy, self.remediation
        if self.runtime != "pagekeeper" and policy.swap_space_gib != 0.0:
            raise ValueError(SWAP_RULE["message"])
        violation = policy.runtime_violation(self.runtime)
        if violation is not None:
            raise ValueError(violation)
        if (info.context or {}).get(STORED_CONTEXT):
            # The API server enforces the rules below on every write. An object it stored under
            # an earlier schema may break them; it is still reconciled as written (alerts follow
            # the runtime whatever `enabled` says) until its next write meets the CRD.
            return self
        if self.runtime != "pagekeeper" and policy.block_size == 8:
            raise ValueError(BLOCK_SIZE_RULE["message"])
        adaptive = remediation.adaptive
        utilization = policy.effective_utilization
        if (
            adaptive.enabled
            and utilization is not None
            and adaptive.min_gpu_memory_utilization > utilization
        ):
            raise ValueError(ADAPTIVE_FLOOR_RULE["message"])
        memory = self.resources.requests.memory
        offload = policy.weight_policy.cpu_offload_gib * 2**30 * self.parallelism.tensor
        if memory is not None and quantity_value(memory) < offload:
            raise ValueError(OFFLOAD_MEMORY_RULE["message"])
        if self.shutdown_grace_period_seconds < remediation.drain_timeout_seconds:
            raise ValueError(DRAIN_RULE["message"])
        canary, autoscaling = self.rollout.canary, self.autoscaling
        if canary.enabled and autoscaling is None and canary.replicas >= self.replicas:
            raise ValueError(CANARY_RULE["message"])
        rollout = self.rollout
        if (
            canary.enabled
            and autoscaling is None
            and rollout.max_surge == 0
            and canary.replicas > rollout.max_unavailable
        ):
            raise ValueError(CANARY_CAPACITY_RULE["message"])
        if (
            canary.enabled
            and autoscaling is not None
            and canary.replicas >= autoscaling.min_replicas
        ):
            raise ValueError(AUTOSCALING_CANARY_RULE["message"])
        if self.runtime == "vllm" and any(
            e.name == "PYTHONPATH" and e.value_from is not None for e in self.pod_template.env
        ):
            raise ValueError(PYTHONPATH_RULE["message"])
        if self.gateway.kv_events.enabled and not policy.enable_prefix_caching:
            raise ValueError(PREFIX_CACHE_RULE["message"])
        gpus, tensor = self.resources.gpus, self.parallelism.tensor
        if gpus is not None and gpus != tensor and not (gpus == 0 and tensor == 1):
            raise ValueError(GPU_RULE["message"])
        for trigger in TRIGGERS:
            if missing_series(self.runtime, trigger) and (
                remediation.triggers.by_key(trigger.key).enabled
            ):
                reason = unfed_message(self.runtime, trigger)
                raise ValueError(_trigger_rule(self.runtime, trigger.key, reason)["message"])
        if self.tuning.mode == "Apply" and not canary.enabled:
            raise ValueError(APPLY_RULE["message"])
        violation = bounds_violation(self.tuning.bounds, policy)
        if violation is not None:
            raise ValueError(violation)
        return self


class ObjectMeta(ApiModel):
    """The parts of metadata the operator reads."""

    name: str = Field(description="Name.")
    namespace: str = Field(default="default", description="Namespace.")
    uid: str = Field(default="", description="UID.")
    generation: int = Field(default=0, description="Generation.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class LLMServer(ApiModel):
    """An LLM served by engine pods on GPUs, with a typed GPU memory policy."""

    api_version: Literal["pagekeeper.dev/v1alpha1"] = Field(
        default="pagekeeper.dev/v1alpha1", description="APIVersion."
    )
    kind: Literal["LLMServer"] = Field(default="LLMServer", description="Kind.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: LLMServerSpec = Field(description="Desired state.")
    status: LLMServerStatus = Field(
        default_factory=LLMServerStatus, description="Observed state, written by the operator."
    )

    @classmethod
    def from_body(cls, body: Any) -> LLMServer:
        """Parse an object as the API (or kopf's body) gives it: stored, so already admitted."""
        return cls.model_validate(dict(body), context={STORED_CONTEXT: True})
