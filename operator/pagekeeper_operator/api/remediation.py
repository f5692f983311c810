"""`LLMServer.spec.remediation` and `status.remediationHistory`: what the operator may do when a
memory alert fires, and the record of what it did.

These models are the single source of the CRD schema: every field carries a description (it
becomes `kubectl explain` text) and only constraints that OpenAPI can express (bounds, patterns,
enums), so the generated schema validates exactly what these models validate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagekeeper_memplan.defaults import MAX_GPU_MEMORY_UTILIZATION
from pagekeeper_operator.api.types import Timestamp

# A Prometheus duration (`30s`, `5m`, `1h30m`, `0m`); units in descending order, each at most once.
DURATION_PATTERN = r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$"
# A non-negative Kubernetes quantity (`1Gi`, `512Mi`, `1073741824`, `1.5G`).
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[kMGTPE])?$"

RemediationAction = Literal["evict", "skip", "dry-run", "step-down"]


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class _Trigger(_Model):
    enabled: bool | None = Field(
        default=None,
        description=(
            "Render this trigger's alert for this server. Unset: on wherever spec.runtime "
            "exports the series the alert reads (status.triggers says which are active and why "
            "the others are not); true for a runtime that cannot feed it is refused; false: off."
        ),
    )

    def is_on_for(self, can_feed: bool) -> bool:
        """Whether the alert is rendered, given whether the runtime exports its series."""
        return can_feed and self.enabled is not False


class FragmentationTrigger(_Trigger):
    """Allocator fragmentation: memory the caching allocator reserved but does not use."""

    threshold: float = Field(
        default=0.25,
        gt=0.0,
        lt=1.0,
        description=(
            "Fire when (reserved - allocated) / reserved exceeds this fraction of the "
            "allocator's reserved bytes."
        ),
    )
    min_bytes: str = Field(
        default="1Gi",
        alias="minBytes",
        pattern=QUANTITY_PATTERN,
        description=(
            "And reserved - allocated exceeds this quantity, so a small pool with a high ratio "
            "does not fire."
        ),
    )
    for_: str = Field(
        default="10m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description="Prometheus duration the condition must hold before the alert fires.",
    )


class KVCacheSaturationTrigger(_Trigger):
    """The paged KV cache is (nearly) full, so requests queue or are preempted."""

    threshold: float = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description="Fire when vllm:kv_cache_usage_perc (a fraction, 0-1) exceeds this value.",
    )
    for_: str = Field(
        default="2m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description="Prometheus duration the condition must hold before the alert fires.",
    )


class QueueBacklogTrigger(_Trigger):
    """Requests wait far longer than they run: the pod admits too little work."""

    ratio: float = Field(
        default=3.0,
        gt=0.0,
        le=1000.0,
        description="Fire when requests waiting exceed this multiple of requests running.",
    )
    for_: str = Field(
        default="5m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description="Prometheus duration the condition must hold before the alert fires.",
    )


class EngineStalledTrigger(_Trigger):
    """Requests wait but none completes: the engine is stuck, not merely idle."""

    for_: str = Field(
        default="5m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description=(
            "How long requests must be waiting with no request succeeding before the alert "
            "fires (Prometheus duration); also the window over which successes are counted."
        ),
    )


class OOMEventsTrigger(_Trigger):
    """The engine recovered from (or died of) an out-of-memory error."""

    for_: str = Field(
        default="0m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description="How long OOM events must keep increasing before the alert fires; 0m: at once.",
    )


class HostMemoryTrigger(_Trigger):
    """The engine container's memory working set nears its memory limit: past the limit the
    kernel kills the container (OOMKilled), with every request in flight."""

    threshold: float = Field(
        default=0.9,
        gt=0.0,
        lt=1.0,
        description=(
            "Fire when the engine container's working set (cAdvisor's "
            "container_memory_working_set_bytes) exceeds this fraction of its memory limit "
            "(kube-state-metrics' kube_pod_container_resource_limits). A container without a "
            "memory limit never fires."
        ),
    )
    for_: str = Field(
        default="2m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description=(
            "Prometheus duration the condition must hold before the alert fires; long enough "
            "to pass over the page cache of a checkpoint being read at start-up."
        ),
    )


class KVOffloadOverCapacityTrigger(_Trigger):
    """The host KV tier holds more bytes than its capacity: the bound the pod's memory was
    sized on no longer holds (a full tier is its steady state and no alarm)."""

    for_: str = Field(
        default="1m",
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description="Prometheus duration the condition must hold before the alert fires.",
    )


class RemediationTriggers(_Model):
    """The alerts rendered for this server, with their thresholds and durations."""

    fragmentation: FragmentationTrigger = Field(
        default_factory=FragmentationTrigger,
        description="Allocator fragmentation high (PagekeeperFragmentationHigh).",
    )
    kv_cache_saturation: KVCacheSaturationTrigger = Field(
        default_factory=KVCacheSaturationTrigger,
        alias="kvCacheSaturation",
        description="KV cache usage critical (PagekeeperKVCacheSaturated).",
    )
    queue_backlog: QueueBacklogTrigger = Field(
        default_factory=QueueBacklogTrigger,
        alias="queueBacklog",
        description="Queue backlog (PagekeeperQueueBacklog).",
    )
    engine_stalled: EngineStalledTrigger = Field(
        default_factory=EngineStalledTrigger,
        alias="engineStalled",
        description="Engine stalled (PagekeeperEngineStalled).",
    )
    oom_events: OOMEventsTrigger = Field(
        default_factory=OOMEventsTrigger,
        alias="oomEvents",
        description="Out-of-memory events (PagekeeperOOMEvents).",
    )
    host_memory: HostMemoryTrigger = Field(
        default_factory=HostMemoryTrigger,
        alias="hostMemory",
        description=(
            "The engine container's memory near its limit (PagekeeperHostMemoryNearLimit); "
            "both runtimes, from the cluster's cAdvisor and kube-state-metrics series."
        ),
    )
    kv_offload_over_capacity: KVOffloadOverCapacityTrigger = Field(
        default_factory=KVOffloadOverCapacityTrigger,
        alias="kvOffloadOverCapacity",
        description=(
            "The host KV tier above its capacity (PagekeeperKVOffloadOverCapacity); runtime "
            "pagekeeper only."
        ),
    )

    def by_key(self, key: str) -> _Trigger:
        """The trigger under its camelCase key (`api.runtime.TRIGGERS`)."""
        for name, field in type(self).model_fields.items():
            if (field.alias or name) == key:
                trigger = getattr(self, name)
                assert isinstance(trigger, _Trigger), f"{key} is not a trigger"
                return trigger
        raise KeyError(key)


class AdaptiveSpec(_Model):
    """How the effective memory policy steps down after out-of-memory crashes, each on its own
    side: a run-time GPU OOM lowers the GPU terms, a host OOM (OOMKilled) shrinks the host KV
    tier.

    The spec is never written; the stepped-down policy lives in status.effectiveMemoryPolicy.
    """

    enabled: bool = Field(
        default=True,
        description=(
            "Step the effective policy down after a run-time GPU OOM crash or a host OOM kill."
        ),
    )
    utilization_step: float = Field(
        default=0.05,
        gt=0.0,
        le=0.5,
        alias="utilizationStep",
        description="Subtract this from the effective gpuMemoryUtilization per step.",
    )
    min_gpu_memory_utilization: float = Field(
        default=0.7,
        gt=0.0,
        le=MAX_GPU_MEMORY_UTILIZATION,
        alias="minGpuMemoryUtilization",
        description="Floor for the effective gpuMemoryUtilization.",
    )
    max_num_batched_tokens_step: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        alias="maxNumBatchedTokensStep",
        description=(
            "Once utilization is at its floor, multiply the effective maxNumBatchedTokens by "
            "this factor per step."
        ),
    )
    min_max_num_batched_tokens: int = Field(
        default=2048,
        ge=1,
        alias="minMaxNumBatchedTokens",
        description="Floor for the effective maxNumBatchedTokens.",
    )
    kv_offload_step: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        alias="kvOffloadStep",
        description=(
            "After a host out-of-memory kill (OOMKilled), multiply the effective "
            "memoryPolicy.kvOffload.size by this factor (whole MiB). No tier: nothing to shrink, "
            "the kill is recorded only."
        ),
    )
    min_kv_offload_size: str = Field(
        default="1Gi",
        alias="minKvOffloadSize",
        pattern=QUANTITY_PATTERN,
        description=(
            "A host KV tier the next step would make smaller than this is switched off "
            "(kvOffload unset in the effective policy) instead."
        ),
    )


class RemediationSpec(_Model):
    """What the operator may do when one of this server's memory alerts fires."""

    enabled: bool = Field(
        default=True, description="Act on this server's alerts; when false the alerts only notify."
    )
    dry_run: bool = Field(
        default=False,
        alias="dryRun",
        description="Record in status and Events what would be done, without evicting.",
    )
    cooldown_seconds: int = Field(
        default=600,
        ge=0,
        le=86400,
        alias="cooldownSeconds",
        description="After an action on this server, take no other for this many seconds.",
    )
    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=100,
        alias="maxUnavailable",
        description=(
            "Evict only while at most this many of the server's pods would be unavailable "
            "(not ready, terminating, or being evicted)."
        ),
    )
    drain_timeout_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        alias="drainTimeoutSeconds",
        description=(
            "How long an evicted pod counts as being evicted (toward maxUnavailable) while it "
            "drains; past it, a pod still present is reported (EvictionStuck Event) and no "
            "longer counted. At most spec.shutdownGracePeriodSeconds, the time the engine gets "
            "to drain before the kubelet stops it."
        ),
    )
    hysteresis_seconds: int = Field(
        default=60,
        ge=0,
        le=86400,
        alias="hysteresisSeconds",
        description="Act only on alerts that have been firing (by startsAt) for this long.",
    )
    memory_healthy_after_seconds: int = Field(
        default=3600,
        ge=1,
        le=604800,
        alias="memoryHealthyAfterSeconds",
        description=(
            "The MemoryHealthy condition, set False by an out-of-memory termination, turns True "
            "again once no other has been seen for this many seconds (status.lastOutOfMemory). "
            "A stepped-down effective memory policy stays stepped down."
        ),
    )
    history_limit: int = Field(
        default=20,
        ge=1,
        le=100,
        alias="historyLimit",
        description="Keep this many most recent entries in status.remediationHistory.",
    )
    triggers: RemediationTriggers = Field(
        default_factory=RemediationTriggers,
        description="The alerts rendered for this server, with thresholds and durations.",
    )
    adaptive: AdaptiveSpec = Field(
        default_factory=AdaptiveSpec,
        description="Stepping the effective memory policy down after GPU OOM crashes.",
    )


class RemediationRecord(_Model):
    """One entry of status.remediationHistory: an action taken, or one deliberately not taken."""

    time: Timestamp = Field(description="When it happened (RFC 3339, UTC).")
    pod: str = Field(max_length=253, description="The pod acted on.")
    alert: str = Field(
        max_length=128,
        description="The alert name (or the OOM classification for step-down).",
    )
    action: RemediationAction = Field(
        description=(
            "evict: evicted through the Eviction API; skip: deliberately not acted on; "
            "dry-run: would have evicted; step-down: lowered the effective memory policy."
        )
    )
    outcome: str = Field(
        max_length=64,
        description=(
            "What came of it. evict: evicted, pdb-blocked, pod-gone or failed (evicting while "
            "the Eviction API has not answered: written first, so an operator that dies "
            "meanwhile is followed by one that settles it); skip: "
            "skipped; dry-run: would-evict; step-down: applied, would-apply, at-floor, "
            "not-applicable or disabled."
        ),
    )
    message: str = Field(default="", max_length=1024, description="Human-readable detail.")
    fingerprint: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Alertmanager fingerprint of the alert (for step-down: of the termination), so a "
            "repeated delivery is not acted on twice."
        ),
    )
    alert_starts_at: Timestamp | None = Field(
        default=None,
        alias="alertStartsAt",
        description=(
            "startsAt of the alert (for step-down: finishedAt of the termination), RFC 3339; "
            "with fingerprint, the identity of what was acted on."
        ),
    )
