"""The memory alerts shipped with each LLMServer, rendered from `spec.remediation` (pure).

Each alert reads only the series its trigger lists (`api.runtime.TRIGGERS`), and is rendered
only where the server's runtime exports them (`triggers.is_active`): under runtime vllm with
VLLM_PLUGINS leaving out pagekeeper's plugin, which exports the allocator and OOM series from
vLLM's processes, the fragmentation and OOM alerts are left out rather than rendered to never
fire. Expressions select a server's series by the `namespace` and
`llmserver` labels. Scrapes must carry `namespace`, `pod`
and `llmserver` (the ServiceMonitor relabels the pod label `pagekeeper.dev/llmserver` to
`llmserver`); each expression aggregates `by (namespace, pod, llmserver)`, so every alert names
exactly one pod, which is what the remediation webhook acts on. The host-memory alert reads
the cluster's own series (cAdvisor, kube-state-metrics), which carry `namespace`, `pod` and
`container` but not `llmserver`: it takes that label from the pod's scrape target (`up`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import CLUSTER_SERIES, TRIGGER_BY_KEY, TRIGGERS, Runtime
from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.triggers import is_active

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
ALERT_HOST_MEMORY = TRIGGER_BY_KEY["hostMemory"].alert
ALERT_KV_OFFLOAD_OVER_CAPACITY = TRIGGER_BY_KEY["kvOffloadOverCapacity"].alert
ALERT_NAMES: tuple[str, ...] = tuple(trigger.alert for trigger in TRIGGERS)

# Alertmanager routes alerts carrying this label (value "true") to the operator's webhook.
REMEDIATE_LABEL = "pagekeeper_remediate"
RUNBOOK_BASE = "docs/runbook.md"
# The window over which OOM-event increases are counted; the alert stays firing this long.
OOM_WINDOW = "5m"
# The engine's container in the pod (`render.meta.ENGINE_CONTAINER`, which imports this package's
# renderer, so the name is pinned by tests/operator/test_alerts_render.py instead of imported).
ENGINE_CONTAINER = "engine"
# Range selectors need a positive window; shorter stall windows are read as this one.
MIN_STALL_WINDOW = "1m"

_BY = "by (namespace, pod, llmserver)"
_ON = "on (namespace, pod, llmserver)"

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


def runbook_url(alert: str, base: str = RUNBOOK_BASE) -> str:
    """Link to the alert's section of the runbook (headings are the alert names)."""
    return f"{base}#{alert.lower()}"


def _selector(name: str, namespace: str) -> str:
    return f'{{namespace="{namespace}", llmserver="{name}"}}'


def _rule(
    alert: str,
    expr: str,
    for_: str,
    severity: str,
    remediation: RemediationSpec,
    summary: str,
    description: str,
    runbook_base: str,
) -> dict[str, Any]:
    return {
        "alert": alert,
        "expr": expr,
        "for": for_,
        "labels": {
            "severity": severity,
            REMEDIATE_LABEL: "true" if remediation.enabled else "false",
        },
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": runbook_url(alert, runbook_base),
        },
    }


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
    sel = _selector(name, namespace)
    triggers = remediation.triggers

    def active(key: str) -> bool:
        return is_active(runtime, remediation, TRIGGER_BY_KEY[key], has_plugin=has_plugin)

    pod = "{{ $labels.namespace }}/{{ $labels.pod }}"
    rules: list[dict[str, Any]] = []

    frag = triggers.fragmentation
    if active("fragmentation"):
        reserved = f"sum {_BY} (pagekeeper_allocator_reserved_bytes{sel})"
        allocated = f"sum {_BY} (pagekeeper_allocator_allocated_bytes{sel})"
        unused = f"({reserved} - {allocated})"
        expr = (
            f"{unused} / {reserved} > {frag.threshold}\n"
            f"and {_ON}\n{unused} > {quantity_bytes(frag.min_bytes)}"
        )
        rules.append(
            _rule(
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
            _rule(
                ALERT_KV_CACHE_SATURATED,
                f"max {_BY} (vllm:kv_cache_usage_perc{sel}) > {kv.threshold}",
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
        waiting = f"sum {_BY} (vllm:num_requests_waiting{sel})"
        running = f"sum {_BY} (vllm:num_requests_running{sel})"
        expr = f"{waiting} > {backlog.ratio} * {running}\nand {_ON}\n{waiting} > 0"
        rules.append(
            _rule(
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
            f"sum {_BY} (min_over_time({waiting}[{window}])) > 0\n"
            f"and {_ON}\nsum {_BY} ({waiting} offset {window})\n"
            f"unless {_ON}\n"
            f"sum {_BY} (increase(vllm:request_success_total{sel}[{window}])) > 0"
        )
        rules.append(
            _rule(
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
            _rule(
                ALERT_OOM_EVENTS,
                f"sum {_BY} (increase(pagekeeper_oom_events_total{sel}[{OOM_WINDOW}])) > 0",
                oom.for_,
                "critical",
                remediation,
                f"Out-of-memory events on {pod}",
                "pagekeeper_oom_events_total rose by {{ $value | humanize }} "
                f"in the last {OOM_WINDOW}.",
                runbook_base,
            )
        )

    host = triggers.host_memory
    if active("hostMemory"):
        rules.append(
            _rule(
                ALERT_HOST_MEMORY,
                f"{_working_set_ratio(namespace, sel)} > {host.threshold}",
                host.for_,
                "critical",
                remediation,
                f"Engine container memory near its limit on {pod}",
                "The engine container's memory working set is {{ $value | humanizePercentage }} "
                f"of its memory limit (threshold {host.threshold}) for {host.for_}; at the "
                "limit the kernel kills it (OOMKilled).",
                runbook_base,
            )
        )

    over = triggers.kv_offload_over_capacity
    if active("kvOffloadOverCapacity"):
        used = f"sum {_BY} (pagekeeper_kv_offload_bytes_used{sel})"
        capacity = f"sum {_BY} (pagekeeper_kv_offload_bytes_capacity{sel})"
        rules.append(
            _rule(
                ALERT_KV_OFFLOAD_OVER_CAPACITY,
                f"{used}\n> {_ON}\n{capacity}",
                over.for_,
                "critical",
                remediation,
                f"Host KV tier above its capacity on {pod}",
                # A full tier is an LRU cache's steady state, so fullness alone is not alarmed
                # on; holding more than its capacity breaks the bound the pod's memory limit was
                # sized on, and the container is on its way to an OOM kill.
                "The host KV tier holds {{ $value | humanize1024 }}B, more than its capacity, "
                f"for {over.for_}: the tier's bound, which the pod's memory limit counts on, "
                "does not hold.",
                runbook_base,
            )
        )
    return rules


def _working_set_ratio(namespace: str, server_sel: str) -> str:
    """The engine container's working set over its memory limit, per pod, labelled with the
    pod's `llmserver` from its scrape target (`group` is 1 per pod, whatever its endpoints)."""
    container = f'{{namespace="{namespace}", container="{ENGINE_CONTAINER}"}}'
    limit = f'{{namespace="{namespace}", container="{ENGINE_CONTAINER}", resource="memory"}}'
    return (
        f"max by (namespace, pod) (container_memory_working_set_bytes{container})\n"
        f"/ on (namespace, pod)\n"
        f"max by (namespace, pod) (kube_pod_container_resource_limits{limit} > 0)\n"
        f"* on (namespace, pod) group_left (llmserver)\n"
        f"group by (namespace, pod, llmserver) (up{server_sel})"
    )


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
