"""`LLMServer` (pagekeeper.dev/v1alpha1): one model served by GPU pods under a memory policy.

These pydantic models are the single source of the CRD (`python -m pagekeeper_operator.crdgen`):
field descriptions become `kubectl explain` text, bounds become schema, cross-field rules CEL
(those across the spec's sections: `spec_rules`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from pagekeeper_operator.api.autoscaling import AutoscalingSpec
from pagekeeper_operator.api.gateway import PREFIX_CACHE_RULE, GatewaySpec
from pagekeeper_operator.api.lifecycle import LifecycleSpec
from pagekeeper_operator.api.pod import PodTemplateOverrides
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.rollout import RolloutSpec
from pagekeeper_operator.api.runtime import (
    TRIGGERS,
    VLLM_PLUGINS_ENV,
    Runtime,
    missing_series,
    unfed_message,
    vllm_loads_plugin,
)
from pagekeeper_operator.api.spec_rules import (
    ADAPTIVE_FLOOR_RULE,
    AUTOSCALING_CANARY_RULE,
    BLOCK_SIZE_RULE,
    CANARY_CAPACITY_RULE,
    CANARY_RULE,
    DRAIN_RULE,
    GPU_RULE,
    OFFLOAD_MEMORY_RULE,
    PYTHONPATH_RULE,
    SPEC_RULES,
    SWAP_RULE,
    trigger_rule,
)
from pagekeeper_operator.api.status import LLMServerStatus
from pagekeeper_operator.api.tuning import APPLY_RULE, TuningSpec, bounds_violation
from pagekeeper_operator.api.types import ApiModel, quantity_value, validations
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


class LLMServerSpec(ApiModel):
    """Desired state of an LLMServer."""

    model_config = ConfigDict(json_schema_extra=validations(*SPEC_RULES))

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
        is_stored = bool((info.context or {}).get(STORED_CONTEXT))
        violation = spec_violation(self, is_stored=is_stored)
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


def spec_violation(spec: LLMServerSpec, *, is_stored: bool = False) -> str | None:
    """The message of the first rule `spec` breaks, or None.

    A stored object (`is_stored`, read back from the API server) is held only to what the
    runtime must have: the API server enforces the rest on every write, and an object it stored
    under an earlier schema may break them; it is still reconciled as written (alerts follow
    the runtime whatever `enabled` says) until its next write meets the CRD.
    """
    policy, remediation = spec.memory_policy, spec.remediation
    if spec.runtime != "pagekeeper" and policy.swap_space_gib != 0.0:
        return SWAP_RULE["message"]
    violation = policy.runtime_violation(spec.runtime)
    if violation is not None or is_stored:
        return violation
    if spec.runtime != "pagekeeper" and policy.block_size == 8:
        return BLOCK_SIZE_RULE["message"]
    adaptive = remediation.adaptive
    utilization = policy.effective_utilization
    if (
        adaptive.enabled
        and utilization is not None
        and adaptive.min_gpu_memory_utilization > utilization
    ):
        return ADAPTIVE_FLOOR_RULE["message"]
    memory = spec.resources.requests.memory
    offload = policy.weight_policy.cpu_offload_gib * 2**30 * spec.parallelism.tensor
    if memory is not None and quantity_value(memory) < offload:
        return OFFLOAD_MEMORY_RULE["message"]
    if spec.shutdown_grace_period_seconds < remediation.drain_timeout_seconds:
        return DRAIN_RULE["message"]
    rollout, autoscaling = spec.rollout, spec.autoscaling
    canary = rollout.canary
    if canary.enabled and autoscaling is None and canary.replicas >= spec.replicas:
        return CANARY_RULE["message"]
    if (
        canary.enabled
        and autoscaling is None
        and rollout.max_surge == 0
        and canary.replicas > rollout.max_unavailable
    ):
        return CANARY_CAPACITY_RULE["message"]
    if canary.enabled and autoscaling is not None and canary.replicas >= autoscaling.min_replicas:
        return AUTOSCALING_CANARY_RULE["message"]
    if spec.runtime == "vllm" and any(
        e.name == "PYTHONPATH" and e.value_from is not None for e in spec.pod_template.env
    ):
        return PYTHONPATH_RULE["message"]
    if spec.gateway.kv_events.enabled and not policy.enable_prefix_caching:
        return PREFIX_CACHE_RULE["message"]
    gpus, tensor = spec.resources.gpus, spec.parallelism.tensor
    if gpus is not None and gpus != tensor and not (gpus == 0 and tensor == 1):
        return GPU_RULE["message"]
    for trigger in TRIGGERS:
        if missing_series(spec.runtime, trigger) and (
            remediation.triggers.by_key(trigger.key).enabled
        ):
            reason = unfed_message(spec.runtime, trigger)
            return trigger_rule(spec.runtime, trigger.key, reason)["message"]
    if spec.tuning.mode == "Apply" and not canary.enabled:
        return APPLY_RULE["message"]
    return bounds_violation(spec.tuning.bounds, policy)
