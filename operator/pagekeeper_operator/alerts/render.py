"""The memory alerts shipped with each LLMServer, rendered from `spec.remediation` (pure).

Each alert reads only the series its trigger lists (`api.runtime.TRIGGERS`), and is rendered
only where the server's runtime exports them (`triggers.is_active`): under runtime vllm with
VLLM_PLUGINS leaving out pagekeeper's plugin, which exports the allocator and OOM series from
vLLM's processes, the fragmentation and OOM alerts are left out rather than rendered to never
fire. Scrapes must carry `namespace`, `pod` and `llmserver` (the ServiceMonitor relabels the
pod label `pagekeeper.dev/llmserver` to `llmserver`); one rule's shape and the aggregation
every expression shares are `rule`'s, the host-memory alerts `host`'s.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from pagekeeper_operator.alerts.host import (
    ALERT_HOST_MEMORY,
    ALERT_KV_OFFLOAD_OVER_CAPACITY,
    ENGINE_CONTAINER,
    host_alert_rules,
)
from pagekeeper_operator.alerts.rule import (
    BY,
    ON,
    REMEDIATE_LABEL,
    RUNBOOK_BASE,
    alert_rule,
    runbook_url,
    server_selector,
)
from pagekeeper_operator.alerts.triggers import is_active
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import CLUSTER_SERIES, TRIGGER_BY_KEY, TRIGGERS, Runtime
from pagekeeper_operator.api.types import quantity_value

__all__ = [
    "ALERT_HOST_MEMORY", "ALERT_KV_OFFLOAD_OVER_CAPACITY", "ENGINE_CONTAINER", "REMEDIATE_LABEL",
    "RUNBOOK_BASE", "runbook_url",
]  # fmt: skip

# The engine metrics these alerts read; a contract test checks the engine exports each one.
ENGINE_METRICS_USED: tuple[str, ...] = tuple(
    dict.fromkeys(
        name for trigger in TRIGGERS for name in trigger.series if name not in CLUSTER_SERIES
    )
)

ALERT_FRAGMENTATION = TRIGGER_BY_KEY["fragmentation"].alert
ALERT_KV_CACHE_SATURATED = TRIGGER_BY_KEY["kvCacheSaturation"].alert
ALERT_QUEUE_BACKLOG = TRIGGER_BY_KEY["queueBacklog"].alert
ALERT_ENGINE_STALLED = TRIGGER_BY_KEY["engineStalled"].alert
ALERT_OOM_EVENTS = TRIGGER_BY_KEY["oomEvents"].alert
ALERT_NAMES: tuple[str, ...] = tuple(trigger.alert for trigger in TRIGGERS)

# The window over which OOM-event increases are counted; the alert stays firing this long.
OOM_WINDOW = "5m"
# Range selectors need a positive window; shorter stall windows are read as this one.
MIN_STALL_WINDOW = "1m"

_DURATION_RE = re.compile(r"([0-9]+)(ms|y|w|d|h|m|s)")
_DURATION_MS: dict[str, int] = {
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
    "w": 604_800_000,
    "y": 31_536_000_000,
}


def quantity_bytes(quantity: str) -> int:
    """Bytes in a non-negative Kubernetes quantity (`1Gi`, `512M`, `1073741824`), rounded up."""
    return math.ceil(quantity_value(quantity))


def duration_seconds(duration: str) -> float:
    """Seconds in a Prometheus duration (`1h30m`, `0m`, `0`)."""
    if duration == "0":
        return 0.0
    parts = _DURATION_RE.findall(duration)
    if not parts or "".join(number + unit for number, unit in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(number) * _DURATION_MS[unit] for number, unit in parts) / 1000.0


def render_alert_rules(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    runtime: Runtime,
    runbook_base: str = RUNBOOK_BASE,
    *,
    has_plugin: bool = True,
) -> list[dict[str, Any]]:
    """The alerting rules for one LLMServer: one per active trigger (`triggers.is_active`: on
    in spec, and fed by the runtime's series), in `ALERT_NAMES` order."""
    sel = server_selector(name, namespace)
    triggers = remediation.triggers

    def active(key: str) -> bool:
        return is_active(runtime, remediation, TRIGGER_BY_KEY[key], has_plugin=has_plugin)

    pod = "{{ $labels.namespace }}/{{ $labels.pod }}"
    rules: list[dict[str, Any]] = []

    frag = triggers.fragmentation
    if active("fragmentation"):
        reserved = f"sum {BY} (pagekeeper_allocator_reserved_bytes{sel})"
        allocated = f"sum {BY} (pagekeeper_allocator_allocated_bytes{sel})"
        unused = f"({reserved} - {allocated})"
        expr = (
            f"{unused} / {reserved} > {frag.threshold}\n"
            f"and {ON}\n{unused} > {quantity_bytes(frag.min_bytes)}"
        )
        rules.append(
            alert_rule(
                ALERT_FRAGMENTATION,
                expr,
                frag.for_,
                "warning",
                remediation,
                f"GPU allocator fragmentation high on {pod}",
                "{{ $value | humanizePercentage }} of the memory the caching allocator reserved "
                f"is unused (threshold {frag.threshold}, at least {frag.min_bytes}) "
                f"for {frag.for_}.",
                runbook_base,
            )
        )

    kv = triggers.kv_cache_saturation
    if active("kvCacheSaturation"):
        rules.append(
            alert_rule(
                ALERT_KV_CACHE_SATURATED,
                f"max {BY} (vllm:kv_cache_usage_perc{sel}) > {kv.threshold}",
                kv.for_,
                "warning",
                remediation,
                f"KV cache nearly full on {pod}",
                "KV cache usage is {{ $value | humanizePercentage }} "
                f"(threshold {kv.threshold}) for {kv.for_}.",
                runbook_base,
            )
        )

    backlog = triggers.queue_backlog
    if active("queueBacklog"):
        waiting = f"sum {BY} (vllm:num_requests_waiting{sel})"
        running = f"sum {BY} (vllm:num_requests_running{sel})"
        expr = f"{waiting} > {backlog.ratio} * {running}\nand {ON}\n{waiting} > 0"
        rules.append(
            alert_rule(
                ALERT_QUEUE_BACKLOG,
                expr,
                backlog.for_,
                "warning",
                remediation,
                f"Request queue backlog on {pod}",
                "{{ $value }} requests are waiting, more than "
                f"{backlog.ratio} times those running, for {backlog.for_}.",
                runbook_base,
            )
        )

    stalled = triggers.engine_stalled
    if active("engineStalled"):
        window = stalled.for_
        if duration_seconds(window) < duration_seconds(MIN_STALL_WINDOW):
            window = MIN_STALL_WINDOW
        # Requests waiting at every scrape of the window, the pod scraped since the window began
        # (a new pod's first scrapes are not a window), and no request succeeded in it. `unless`
        # rather than `and ... == 0`: an engine that never succeeded has no success series.
        waiting = f"vllm:num_requests_waiting{sel}"
        expr = (
            f"sum {BY} (min_over_time({waiting}[{window}])) > 0\n"
            f"and {ON}\nsum {BY} ({waiting} offset {window})\n"
            f"unless {ON}\n"
            f"sum {BY} (increase(vllm:request_success_total{sel}[{window}])) > 0"
        )
        rules.append(
            alert_rule(
                ALERT_ENGINE_STALLED,
                expr,
                "0m",
                "critical",
                remediation,
                f"Engine stalled on {pod}",
                "At least {{ $value }} requests have been waiting and none has succeeded "
                f"for {window}.",
                runbook_base,
            )
        )

    oom = triggers.oom_events
    if active("oomEvents"):
        rules.append(
            alert_rule(
                ALERT_OOM_EVENTS,
                f"sum {BY} (increase(pagekeeper_oom_events_total{sel}[{OOM_WINDOW}])) > 0",
                oom.for_,
                "critical",
                remediation,
                f"Out-of-memory events on {pod}",
                "pagekeeper_oom_events_total rose by {{ $value | humanize }} "
                f"in the last {OOM_WINDOW}.",
                runbook_base,
            )
        )

    rules += host_alert_rules(
        namespace,
        sel,
        remediation,
        {key: active(key) for key in ("hostMemory", "kvOffloadOverCapacity")},
        runbook_base,
    )
    return rules


def rule_group_name(name: str, namespace: str) -> str:
    return f"pagekeeper.{namespace}.{name}"


def _groups(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    runtime: Runtime,
    runbook_base: str,
    has_plugin: bool,
) -> list[dict[str, Any]]:
    rules = render_alert_rules(
        name, namespace, remediation, runtime, runbook_base, has_plugin=has_plugin
    )
    return [{"name": rule_group_name(name, namespace), "rules": rules}] if rules else []


def prometheus_rule_name(name: str) -> str:
    return f"{name}-memory-alerts"


def render_prometheus_rule(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    runtime: Runtime,
    owner_ref: dict[str, Any] | None,
    runbook_base: str = RUNBOOK_BASE,
    *,
    has_plugin: bool = True,
) -> dict[str, Any]:
    """A `monitoring.coreos.com/v1` PrometheusRule holding this server's alerts."""
    metadata: dict[str, Any] = {
        "name": prometheus_rule_name(name),
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/managed-by": "pagekeeper",
            "app.kubernetes.io/component": "alerts",
            "pagekeeper.dev/llmserver": name,
        },
    }
    if owner_ref is not None:
        metadata["ownerReferences"] = [owner_ref]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": metadata,
        "spec": {
            "groups": _groups(name, namespace, remediation, runtime, runbook_base, has_plugin)
        },
    }


def render_rules_file(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    runtime: Runtime,
    runbook_base: str = RUNBOOK_BASE,
    *,
    has_plugin: bool = True,
) -> str:
    """The same alerts as a plain Prometheus rules file, for clusters without the Operator."""
    groups = _groups(name, namespace, remediation, runtime, runbook_base, has_plugin)
    return yaml.dump({"groups": groups}, Dumper=_RulesDumper, sort_keys=False, width=1000)


class _RulesDumper(yaml.SafeDumper):
    """Writes multi-line expressions as literal blocks, the way people write rules files."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RulesDumper.add_representer(str, _represent_str)
