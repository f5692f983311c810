"""`LLMServer.spec.remediation.triggers`: the memory alerts rendered for a server, each with its
threshold and the duration it must hold.

Like the rest of spec.remediation these models are the single source of the CRD schema: every
field carries a description (it becomes `kubectl explain` text) and only constraints that OpenAPI
can express.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagekeeper_operator.api.types import AliasedModel

# A Prometheus duration (`30s`, `5m`, `1h30m`, `0m`); units in descending order, each at most once.
DURATION_PATTERN = r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$"
# A non-negative Kubernetes quantity (`1Gi`, `512Mi`, `1073741824`, `1.5G`).
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[kMGTPE])?$"


HOLD_DESCRIPTION = "Prometheus duration the condition must hold before the alert fires."


def _hold_for(default: str, description: str = HOLD_DESCRIPTION) -> Any:
    """A trigger's `for`: the Prometheus duration its condition must hold."""
    return Field(
        default=default,
        alias="for",
        pattern=DURATION_PATTERN,
        min_length=1,
        description=description,
    )


class _Trigger(AliasedModel):
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
    for_: str = _hold_for("10m")


class KVCacheSaturationTrigger(_Trigger):
    """The paged KV cache is (nearly) full, so requests queue or are preempted."""

    threshold: float = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description="Fire when vllm:kv_cache_usage_perc (a fraction, 0-1) exceeds this value.",
    )
    for_: str = _hold_for("2m")


class QueueBacklogTrigger(_Trigger):
    """Requests wait far longer than they run: the pod admits too little work."""

    ratio: float = Field(
        default=3.0,
        gt=0.0,
        le=1000.0,
        description="Fire when requests waiting exceed this multiple of requests running.",
    )
    for_: str = _hold_for("5m")


class EngineStalledTrigger(_Trigger):
    """Requests wait but none completes: the engine is stuck, not merely idle."""

    for_: str = _hold_for(
        "5m",
        (
            "How long requests must be waiting with no request succeeding before the alert "
            "fires (Prometheus duration); also the window over which successes are counted."
        ),
    )


class OOMEventsTrigger(_Trigger):
    """The engine recovered from (or died of) an out-of-memory error."""

    for_: str = _hold_for(
        "0m",
        "How long OOM events must keep increasing before the alert fires; 0m: at once.",
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
    for_: str = _hold_for(
        "2m",
        (
            "Prometheus duration the condition must hold before the alert fires; long enough "
            "to pass over the page cache of a checkpoint being read at start-up."
        ),
    )


class KVOffloadOverCapacityTrigger(_Trigger):
    """The host KV tier holds more bytes than its capacity: the bound the pod's memory was
    sized on no longer holds (a full tier is its steady state and no alarm)."""

    for_: str = _hold_for("1m")


class RemediationTriggers(AliasedModel):
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
