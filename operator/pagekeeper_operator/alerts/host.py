"""The host-memory alerts (pure): the engine container's working set near its memory limit
(PagekeeperHostMemoryNearLimit, both runtimes) and the host KV tier above its capacity
(PagekeeperKVOffloadOverCapacity, runtime pagekeeper).

The working set and the limit are the cluster's own series (cAdvisor, kube-state-metrics),
which carry `namespace`, `pod` and `container` but not `llmserver`: the expressions take that
label from the pod's scrape target (`up`). The tuner reads the same figures (`working_set_ratio`,
`memory_limit`) for its host-tier rule, so the alert and the rule measure one thing.
"""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.alerts.rule import BY, ON, alert_rule
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import TRIGGER_BY_KEY

ALERT_HOST_MEMORY = TRIGGER_BY_KEY["hostMemory"].alert
ALERT_KV_OFFLOAD_OVER_CAPACITY = TRIGGER_BY_KEY["kvOffloadOverCapacity"].alert
# The engine's container in the pod (`render.meta.ENGINE_CONTAINER`, which imports the alerts'
# renderer, so the name is pinned by tests/operator/test_alerts_render.py instead of imported).
ENGINE_CONTAINER = "engine"


def _by_server(expr: str, server_sel: str) -> str:
    """`expr` (one series per namespace and pod) labelled with each pod's `llmserver` from its
    scrape target (`group` is 1 per pod, whatever its endpoints)."""
    return (
        f"{expr}\n* on (namespace, pod) group_left (llmserver)\n"
        f"group by (namespace, pod, llmserver) (up{server_sel})"
    )


def working_set_ratio(namespace: str, server_sel: str) -> str:
    """The engine container's working set over its memory limit, per pod, with `llmserver`."""
    container = f'{{namespace="{namespace}", container="{ENGINE_CONTAINER}"}}'
    limit = f'{{namespace="{namespace}", container="{ENGINE_CONTAINER}", resource="memory"}}'
    ratio = (
        f"max by (namespace, pod) (container_memory_working_set_bytes{container})\n"
        f"/ on (namespace, pod)\n"
        f"max by (namespace, pod) (kube_pod_container_resource_limits{limit} > 0)"
    )
    return _by_server(ratio, server_sel)


def memory_limit(namespace: str, server_sel: str) -> str:
    """The engine container's memory limit in bytes, per pod, with `llmserver` (no series for a
    container without one)."""
    limit = f'{{namespace="{namespace}", container="{ENGINE_CONTAINER}", resource="memory"}}'
    expr = f"max by (namespace, pod) (kube_pod_container_resource_limits{limit} > 0)"
    return _by_server(expr, server_sel)


def host_alert_rules(
    namespace: str,
    sel: str,
    remediation: RemediationSpec,
    is_active: dict[str, bool],
    runbook_base: str,
) -> list[dict[str, Any]]:
    """The host-memory rules whose trigger `is_active` (by trigger key), in TRIGGERS order."""
    triggers = remediation.triggers
    pod = "{{ $labels.namespace }}/{{ $labels.pod }}"
    rules: list[dict[str, Any]] = []
    host = triggers.host_memory
    if is_active["hostMemory"]:
        rules.append(
            alert_rule(
                ALERT_HOST_MEMORY,
                f"{working_set_ratio(namespace, sel)} > {host.threshold}",
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
    if is_active["kvOffloadOverCapacity"]:
        used = f"sum {BY} (pagekeeper_kv_offload_bytes_used{sel})"
        capacity = f"sum {BY} (pagekeeper_kv_offload_bytes_capacity{sel})"
        rules.append(
            alert_rule(
                ALERT_KV_OFFLOAD_OVER_CAPACITY,
                f"{used}\n> {ON}\n{capacity}",
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
