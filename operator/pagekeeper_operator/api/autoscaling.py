"""`spec.autoscaling` and `status.autoscaling`: an autoscaler owns the replica count.

The operator renders the autoscaler (`render.autoscaler`): a HorizontalPodAutoscaler on the pods'
custom metrics served by prometheus-adapter, or a KEDA ScaledObject with Prometheus triggers
where KEDA is installed. Every target is an average per pod, so the desired count is the total
over the pods divided by the target (`ceil(sum / target)`): a pod still loading its model
reports zero and adds nothing, so starting pods never look like capacity. docs/operator.md
("Autoscaling") gives the evidence behind each default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_operator.api.types import ApiModel, Timestamp, cel, validations

AutoscalerKind = Literal["HorizontalPodAutoscaler", "ScaledObject"]
# The HorizontalPodAutoscaler API bounds a stabilization window to one hour.
MAX_WINDOW_SECONDS = 3600
MAX_REPLICAS = 1000

TARGET_RULE = cel(
    "self.kvCacheUsage > 0.0 || self.waitingRequests > 0.0 || self.runningRequests > 0.0",
    "spec.autoscaling.targets must set at least one of kvCacheUsage, waitingRequests and "
    "runningRequests above 0 (0 leaves a signal out; with none the autoscaler has nothing to "
    "scale on)",
)
MIN_MAX_RULE = cel(
    "self.minReplicas <= self.maxReplicas",
    "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
    ".minReplicas",
)


class AutoscalingTargets(ApiModel):
    """What one pod should carry on average; 0 leaves a signal out."""

    model_config = ConfigDict(json_schema_extra=validations(TARGET_RULE))

    kv_cache_usage: float = Field(
        default=0.8,
        ge=0.0,
        le=1.0,
        description=(
            "vllm:kv_cache_usage_perc (the fraction of the pod's KV blocks in use, 0-1) to keep "
            "each pod at on average. The default, 0.8, adds pods (beyond the autoscaler's 10% "
            "tolerance) above 0.88: before the KV-saturation alert's 0.95, so scaling comes "
            "first and remediation only for what it cannot fix. 0: not a signal."
        ),
    )
    waiting_requests: float = Field(
        default=5.0,
        ge=0.0,
        le=100000.0,
        description=(
            "vllm:num_requests_waiting (requests queued in the engine, not yet running) per "
            "pod on average. The default, 5, is the queue per replica the vLLM production "
            "stack's KEDA set-up scales at. 0: not a signal."
        ),
    )
    running_requests: float = Field(
        default=0.0,
        ge=0.0,
        le=100000.0,
        description=(
            "vllm:num_requests_running per pod on average. Off by default (0): how many "
            "requests a pod can run depends on their lengths, which KV-cache usage measures; "
            "set it for short, uniform requests."
        ),
    )

    @model_validator(mode="after")
    def _check_any(self) -> AutoscalingTargets:
        if not (self.kv_cache_usage > 0 or self.waiting_requests > 0 or self.running_requests > 0):
            raise ValueError(TARGET_RULE["message"])
        return self


class AutoscalingSpec(ApiModel):
    """Replicas follow load, between minReplicas and maxReplicas."""

    model_config = ConfigDict(json_schema_extra=validations(MIN_MAX_RULE))

    min_replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="Fewest pods; the autoscaler never goes below it.",
    )
    max_replicas: int = Field(
        ge=1,
        le=MAX_REPLICAS,
        description="Most pods; the autoscaler never goes above it (size it to your GPUs).",
    )
    targets: AutoscalingTargets = Field(
        default_factory=AutoscalingTargets,
        description=(
            "Per-pod targets on the engine's load signals. Each active target proposes "
            "ceil(total over the pods / target) pods and the largest proposal wins."
        ),
    )
    scale_up_stabilization_seconds: int = Field(
        default=30,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description=(
            "A scale-up happens only when every proposal of this many past seconds asks for "
            "more pods, so a burst shorter than this starts no GPU pod."
        ),
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description=(
            "A scale-down goes only as low as the highest proposal of this many past seconds, "
            "so load that pauses and comes back does not shed and reload pods (flapping)."
        ),
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_MAX_RULE["message"])
        return self


class AutoscalingStatus(ApiModel):
    """The autoscaler as the operator last read it."""

    kind: AutoscalerKind = Field(
        description="HorizontalPodAutoscaler, or ScaledObject where KEDA is installed."
    )
    name: str = Field(
        max_length=253,
        description="The HorizontalPodAutoscaler that scales the Deployment (KEDA's own for a "
        "ScaledObject).",
    )
    desired_replicas: int | None = Field(
        default=None, description="The pods it last asked for (its status.desiredReplicas)."
    )
    last_scale_time: Timestamp | None = Field(
        default=None, description="When it last changed the count (RFC 3339)."
    )
    last_scale_reason: str | None = Field(
        default=None,
        max_length=256,
        description=(
            "Why, as read at the change: the direction and counts, and the signal that asked "
            "for the most pods with its per-pod value and target (or the bound that held)."
        ),
    )
    message: str = Field(
        default="",
        max_length=1024,
        description="Why it cannot scale now (its ScalingActive condition), when it cannot.",
    )
