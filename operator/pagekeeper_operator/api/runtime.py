"""What each runtime can feed: the series it exports and the alert triggers that read them.

The alert rules (`alerts`), the status of each trigger (`triggers`) and the CRD rule that refuses
a trigger switched on for a runtime that cannot feed it are all derived from these two tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Runtime = Literal["pagekeeper", "vllm"]
RUNTIMES: tuple[Runtime, ...] = ("pagekeeper", "vllm")

# The metric contract (docs/engine.md, "Metrics"): standard signals carry vLLM's `vllm:` names,
# which both runtimes export; what only pagekeeper measures carries the `pagekeeper_` prefix.
# The paged engine exports all of those; a vLLM pod exports the allocator and OOM series that
# pagekeeper's vLLM plugin reads in its GPU processes (`pagekeeper_vllm.series.EXPORTED_SERIES`,
# pinned by tests/vllm/test_units.py), as long as VLLM_PLUGINS does not leave the plugin out.
RUNTIME_METRIC_PREFIXES: dict[Runtime, tuple[str, ...]] = {
    "pagekeeper": ("vllm:", "pagekeeper_"),
    "vllm": ("vllm:",),
}
VLLM_PLUGIN_SERIES: tuple[str, ...] = (
    "pagekeeper_allocator_reserved_bytes",
    "pagekeeper_allocator_allocated_bytes",
    "pagekeeper_allocator_fragmentation_bytes",
    "pagekeeper_allocator_largest_free_segment_bytes",
    "pagekeeper_allocator_alloc_retries_total",
    "pagekeeper_oom_events_total",
)
# Series the cluster exports for every pod whatever runs in it: the kubelet's cAdvisor (the
# container's memory working set, which the kubelet's OOM kill and eviction judge),
# kube-state-metrics (the container's limits) and Prometheus's own `up` of each scraped target,
# which carries the ServiceMonitor's `llmserver` label to series that lack it.
CLUSTER_SERIES: tuple[str, ...] = (
    "container_memory_working_set_bytes",
    "kube_pod_container_resource_limits",
    "up",
)
# The plugin's entry-point name (`pagekeeper_vllm.plugin.PLUGIN_NAME`) and the variable vLLM
# reads to choose its plugins: unset loads all, else a comma-separated list of names to load.
VLLM_PLUGIN_NAME = "pagekeeper"
VLLM_PLUGINS_ENV = "VLLM_PLUGINS"


def vllm_loads_plugin(value: str | None) -> bool:
    """Whether vLLM loads pagekeeper's plugin given VLLM_PLUGINS (None: unset). vLLM splits the
    value at commas and compares names exactly, so `a, pagekeeper` does not load it."""
    return value is None or VLLM_PLUGIN_NAME in value.split(",")


@dataclass(frozen=True)
class Trigger:
    """One alert trigger of `spec.remediation.triggers`: its key, its alert, what it reads."""

    key: str  # the field under spec.remediation.triggers (camelCase)
    alert: str
    series: tuple[str, ...]


# In the order the alerts are rendered.
TRIGGERS: tuple[Trigger, ...] = (
    Trigger(
        "fragmentation",
        "PagekeeperFragmentationHigh",
        ("pagekeeper_allocator_reserved_bytes", "pagekeeper_allocator_allocated_bytes"),
    ),
    Trigger("kvCacheSaturation", "PagekeeperKVCacheSaturated", ("vllm:kv_cache_usage_perc",)),
    Trigger(
        "queueBacklog",
        "PagekeeperQueueBacklog",
        ("vllm:num_requests_waiting", "vllm:num_requests_running"),
    ),
    Trigger(
        "engineStalled",
        "PagekeeperEngineStalled",
        ("vllm:num_requests_waiting", "vllm:request_success_total"),
    ),
    Trigger("oomEvents", "PagekeeperOOMEvents", ("pagekeeper_oom_events_total",)),
    Trigger("hostMemory", "PagekeeperHostMemoryNearLimit", CLUSTER_SERIES),
    Trigger(
        "kvOffloadOverCapacity",
        "PagekeeperKVOffloadOverCapacity",
        ("pagekeeper_kv_offload_bytes_used", "pagekeeper_kv_offload_bytes_capacity"),
    ),
)
TRIGGER_BY_KEY: dict[str, Trigger] = {trigger.key: trigger for trigger in TRIGGERS}
TRIGGER_BY_ALERT: dict[str, Trigger] = {trigger.alert: trigger for trigger in TRIGGERS}


def exports(runtime: Runtime, name: str, *, has_plugin: bool = True) -> bool:
    """Whether pods of `runtime` export the series `name`; `has_plugin`: under vllm, whether
    pagekeeper's plugin runs in vLLM's processes."""
    if name in CLUSTER_SERIES:
        return True
    if name.startswith(RUNTIME_METRIC_PREFIXES[runtime]):
        return True
    return runtime == "vllm" and has_plugin and name in VLLM_PLUGIN_SERIES


def missing_series(
    runtime: Runtime, trigger: Trigger, *, has_plugin: bool = True
) -> tuple[str, ...]:
    """The series `trigger` reads that `runtime` does not export (empty: it can feed it)."""
    return tuple(n for n in trigger.series if not exports(runtime, n, has_plugin=has_plugin))


def unfed_message(runtime: Runtime, trigger: Trigger, *, has_plugin: bool = True) -> str:
    """Why `trigger` cannot fire under `runtime`: the series it would read and never get."""
    missing = ", ".join(missing_series(runtime, trigger, has_plugin=has_plugin))
    if runtime == "vllm" and not has_plugin:
        return (
            f"runtime vllm does not export {missing}: {VLLM_PLUGINS_ENV} leaves out "
            f"pagekeeper's plugin ({VLLM_PLUGIN_NAME})"
        )
    return f"runtime {runtime} does not export {missing}"
