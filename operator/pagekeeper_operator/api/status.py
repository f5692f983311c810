"""`LLMServer.status`: what the operator observed and what the pods actually run with."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from pagekeeper_operator.api.autoscaling import AutoscalingStatus
from pagekeeper_operator.api.lifecycle import LifecycleStatus
from pagekeeper_operator.api.memory_plan import MemoryPlanStatus
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.rollout import CanaryStatus
from pagekeeper_operator.api.tuning import MAX_RECOMMENDATIONS, Recommendation, TuningStatus
from pagekeeper_operator.api.types import ApiModel, Timestamp

ConditionType = Literal[
    "Ready",
    "Progressing",
    "Degraded",
    "MemoryHealthy",
    "CanaryFailed",
    "PolicyHonored",
    "PluginLoaded",
    "PolicyFits",
    "Reconciling",
    "Stalled",
]
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)
ConditionStatus = Literal["True", "False", "Unknown"]
MAX_HISTORY = 100


class Condition(ApiModel):
    """One observation about the server, in the Kubernetes conditions convention."""

    type: str = Field(
        max_length=64,
        description=(
            "Ready, Progressing, Degraded, MemoryHealthy, CanaryFailed, PolicyHonored, "
            "PluginLoaded, PolicyFits, Reconciling or Stalled."
        ),
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="", max_length=128, description="CamelCase reason for the last transition."
    )
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    last_transition_time: Timestamp | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was computed from."
    )


class TriggerStatus(ApiModel):
    """Whether one alert trigger is active for this server, and why (not)."""

    name: str = Field(
        max_length=64, description="The trigger (a key of spec.remediation.triggers)."
    )
    alert: str = Field(max_length=128, description="The alert it renders.")
    active: bool = Field(description="Whether the alert is rendered for this server.")
    reason: str = Field(
        max_length=64,
        description=(
            "Active; DisabledInSpec (enabled: false); SeriesNotExported (the runtime does not "
            "export a series the alert reads, so it could never fire)."
        ),
    )
    message: str = Field(default="", max_length=1024, description="Human-readable detail.")


class LLMServerStatus(ApiModel):
    """Observed state of an LLMServer, written only by the operator."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation the operator last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description=(
            "Ready, Progressing, Degraded, MemoryHealthy; CanaryFailed while "
            "spec.rollout.canary is enabled; under runtime vllm PolicyHonored (whether the "
            "image's vLLM version honours every memoryPolicy field) and PluginLoaded (whether "
            "VLLM_PLUGINS lets pagekeeper's plugin export the allocator series); PolicyFits "
            "(whether the memory plan fits the GPU; a spec that does not is not rolled out); "
            "Reconciling (a rollout, canary analysis or drain is under way) and Stalled (no "
            "progress is possible until the spec changes), the conditions kstatus and Flux read."
        ),
    )
    replicas: int | None = Field(default=None, description="Pods the Deployment has.")
    desired_replicas: int | None = Field(
        default=None,
        description=(
            "Pods the server should have now: spec.replicas, or under spec.autoscaling the "
            "count the autoscaler last set on the Deployment."
        ),
    )
    ready_replicas: int | None = Field(default=None, description="Pods ready to serve.")
    updated_replicas: int | None = Field(
        default=None, description="Pods running the current pod template (memory policy)."
    )
    selector: str | None = Field(
        default=None, description="Label selector of the pods (for the scale subresource)."
    )
    effective_memory_policy: MemoryPolicy | None = Field(
        default=None,
        description=(
            "The memory policy the pods run with: spec.memoryPolicy, possibly stepped down "
            "after out-of-memory crashes (see spec.remediation.adaptive). Never written to spec."
        ),
    )
    spec_memory_policy_hash: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Hash of the spec.memoryPolicy that effectiveMemoryPolicy derives from; when spec "
            "changes, the effective policy starts again from the new spec."
        ),
    )
    policy_hash: str | None = Field(
        default=None,
        max_length=64,
        description="Hash of effectiveMemoryPolicy (the pods' pagekeeper.dev/policy-hash).",
    )
    triggers: list[TriggerStatus] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description=(
            "The alert triggers of spec.remediation: which are active for this server's runtime "
            "and spec, and why the others are not."
        ),
    )
    memory_plan: MemoryPlanStatus | None = Field(
        default=None,
        description=(
            "The memory plan of the spec's policy: each rank's weights, activations, CUDA "
            "graphs, non-torch memory, fragmentation buffer and KV cache on the GPU assumed, "
            "the tokens and maxModelLen sequences the KV cache holds, and the verdict "
            "(condition PolicyFits)."
        ),
    )
    canary: CanaryStatus | None = Field(
        default=None,
        description=(
            "The canary of the latest pod-template change under spec.rollout.canary: analyzing, "
            "promoted or failed, with the failing signal and its value."
        ),
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None,
        description=(
            "The autoscaler under spec.autoscaling: what it last asked for, when and why, or "
            "why it cannot scale."
        ),
    )
    recommendations: list[Recommendation] = Field(
        default_factory=list,
        max_length=MAX_RECOMMENDATIONS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["field"],
        },
        description=(
            "The tuner's current recommendations under spec.tuning, best first, one per field, "
            "each with its evidence from the window; never written to spec. Accept one with "
            "the annotation pagekeeper.dev/accept-recommendation=<field>."
        ),
    )
    tuning: TuningStatus | None = Field(
        default=None,
        description=(
            "The tuner's layers of the effective policy (accepted and promoted changes, the "
            "step-down caps) and, in Apply mode, the trial under way, outcomes and hold-offs."
        ),
    )
    lifecycle: LifecycleStatus | None = Field(
        default=None,
        description=(
            "Under spec.lifecycle.maxPodAge: the oldest pod's creation time, the pod last "
            "replaced for its age and when, and the pod that waits and why."
        ),
    )
    last_remediation: Timestamp | None = Field(
        default=None, description="Time of the most recent remediation (RFC 3339)."
    )
    last_out_of_memory: Timestamp | None = Field(
        default=None,
        description=(
            "When the operator last saw a pod's container end by running out of memory "
            "(RFC 3339); MemoryHealthy stays False until "
            "spec.remediation.memoryHealthyAfterSeconds have passed since."
        ),
    )
    remediation_history: list[RemediationRecord] = Field(
        default_factory=list,
        max_length=MAX_HISTORY,
        description="Most recent remediations, oldest first (spec.remediation.historyLimit).",
    )

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
