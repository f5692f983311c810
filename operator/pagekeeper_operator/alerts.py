"""The memory alerts shipped with each LLMServer, rendered from `spec.remediation` (pure).

Every expression reads only the engine's metric contract (`ENGINE_METRICS_USED`) and selects a
server's series by the `namespace` and `llmserver` labels. Scrapes must carry `namespace`, `pod`
and `llmserver` (the ServiceMonitor relabels the pod label `pagekeeper.dev/llmserver` to
`llmserver`); each expression aggregates `by (namespace, pod, llmserver)`, so every alert names
exactly one pod, which is what the remediation webhook acts on.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from pagekeeper_operator.api.remediation import RemediationSpec

# The engine metrics these alerts read; a contract test checks the engine exports each one.
ENGINE_METRICS_USED: tuple[str, ...] = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_success_total",
    "pagekeeper_allocator_reserved_bytes",
    "pagekeeper_allocator_allocated_bytes",
    "pagekeeper_oom_events_total",
)

ALERT_FRAGMENTATION = "PagekeeperFragmentationHigh"
ALERT_KV_CACHE_SATURATED = "PagekeeperKVCacheSaturated"
ALERT_QUEUE_BACKLOG = "PagekeeperQueueBacklog"
ALERT_ENGINE_STALLED = "PagekeeperEngineStalled"
ALERT_OOM_EVENTS = "PagekeeperOOMEvents"
ALERT_NAMES: tuple[str, ...] = (
    ALERT_FRAGMENTATION,
    ALERT_KV_CACHE_SATURATED,
    ALERT_QUEUE_BACKLOG,
    ALERT_ENGINE_STALLED,
    ALERT_OOM_EVENTS,
)

# Alertmanager routes alerts carrying this label (value "true") to the operator's webhook.
REMEDIATE_LABEL = "pagekeeper_remediate"
RUNBOOK_BASE = "docs/runbook.md"
# The window over which OOM-event increases are counted; the alert stays firing this long.
OOM_WINDOW = "5m"
# Range selectors need a positive window; shorter stall windows are read as this one.
MIN_STALL_WINDOW = "1m"

_BY = "by (namespace, pod, llmserver)"
_ON = "on (namespace, pod, llmserver)"

_QUANTITY_RE = re.compile(
    r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[kMGTPE])?$"
)
_SUFFIX_MULTIPLIER: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
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


def parse_quantity(quantity: str) -> int:
    """Bytes in a non-negative Kubernetes quantity (`1Gi`, `512M`, `1073741824`), rounded up."""
    match = _QUANTITY_RE.fullmatch(quantity)
    if match is None:
        raise ValueError(f"not a byte quantity: {quantity!r}")
    whole, _, fraction = match["number"].partition(".")
    multiplier = _SUFFIX_MULTIPLIER[match["suffix"] or ""]
    # Exact integer arithmetic: `1.5Gi` must not pick up float rounding.
    scale: int = 10 ** len(fraction)
    numerator = int(whole or "0") * scale + int(fraction or "0")
    return -(-numerator * multiplier // scale)


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
    runbook_base: str = RUNBOOK_BASE,
) -> list[dict[str, Any]]:
    """The alerting rules for one LLMServer: one per enabled trigger, in `ALERT_NAMES` order."""
    sel = _selector(name, namespace)
    triggers = remediation.triggers
    pod = "{{ $labels.namespace }}/{{ $labels.pod }}"
    rules: list[dict[str, Any]] = []

    frag = triggers.fragmentation
    if frag.enabled:
        reserved = f"sum {_BY} (pagekeeper_allocator_reserved_bytes{sel})"
        allocated = f"sum {_BY} (pagekeeper_allocator_allocated_bytes{sel})"
        unused = f"({reserved} - {allocated})"
        expr = (
            f"{unused} / {reserved} > {frag.threshold}\n"
            f"and {_ON}\n{unused} > {parse_quantity(frag.min_bytes)}"
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
    if kv.enabled:
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
    if backlog.enabled:
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
    if stalled.enabled:
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
    if oom.enabled:
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
    return rules


def rule_group_name(name: str, namespace: str) -> str:
    return f"pagekeeper.{namespace}.{name}"


def _groups(
    name: str, namespace: str, remediation: RemediationSpec, runbook_base: str
) -> list[dict[str, Any]]:
    rules = render_alert_rules(name, namespace, remediation, runbook_base)
    return [{"name": rule_group_name(name, namespace), "rules": rules}] if rules else []


def prometheus_rule_name(name: str) -> str:
    return f"{name}-memory-alerts"


def render_prometheus_rule(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    owner_ref: dict[str, Any] | None,
    runbook_base: str = RUNBOOK_BASE,
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
        "spec": {"groups": _groups(name, namespace, remediation, runbook_base)},
    }


def render_rules_file(
    name: str,
    namespace: str,
    remediation: RemediationSpec,
    runbook_base: str = RUNBOOK_BASE,
) -> str:
    """The same alerts as a plain Prometheus rules file, for clusters without the Operator."""
    groups = _groups(name, namespace, remediation, runbook_base)
    return yaml.dump({"groups": groups}, Dumper=_RulesDumper, sort_keys=False, width=1000)


class _RulesDumper(yaml.SafeDumper):
    """Writes multi-line expressions as literal blocks, the way people write rules files."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RulesDumper.add_representer(str, _represent_str)
