"""What each runtime can feed: the series it exports and the alert triggers that read them.

The alert rules (`alerts`), the status of each trigger (`triggers`) and the CRD rule that refuses
a trigger switched on for a runtime that cannot feed it are all derived from these two tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Runtime = Literal["pagekeeper", "vllm"]
RUNTIMES: tuple[Runtime, ...] = ("pagekeeper", "vllm")

# The metric contract (ARCHITECTURE.md): standard signals carry vLLM's `vllm:` names, which both
# runtimes export; what only the paged engine measures carries the `pagekeeper_` prefix.
RUNTIME_METRIC_PREFIXES: dict[Runtime, tuple[str, ...]] = {
    "pagekeeper": ("vllm:", "pagekeeper_"),
    "vllm": ("vllm:",),
}


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
)
TRIGGER_BY_KEY: dict[str, Trigger] = {trigger.key: trigger for trigger in TRIGGERS}
TRIGGER_BY_ALERT: dict[str, Trigger] = {trigger.alert: trigger for trigger in TRIGGERS}


def missing_series(runtime: Runtime, trigger: Trigger) -> tuple[str, ...]:
    """The series `trigger` reads that `runtime` does not export (empty: it can feed it)."""
    prefixes = RUNTIME_METRIC_PREFIXES[runtime]
    return tuple(name for name in trigger.series if not name.startswith(prefixes))


def unfed_message(runtime: Runtime, trigger: Trigger) -> str:
    """Why `trigger` cannot fire under `runtime`: the series it would read and never get."""
    missing = ", ".join(missing_series(runtime, trigger))
    return f"runtime {runtime} does not export {missing}"
