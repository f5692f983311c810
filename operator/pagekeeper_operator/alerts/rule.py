"""One alerting rule as the per-server rule group holds it (pure): its labels, its annotations
with the runbook link, and the selector and aggregation every expression shares.

Expressions select a server's series by the `namespace` and `llmserver` labels and aggregate
`by (namespace, pod, llmserver)`, so every alert names exactly one pod, which is what the
remediation webhook acts on.
"""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.remediation import RemediationSpec

# Alertmanager routes alerts carrying this label (value "true") to the operator's webhook.
REMEDIATE_LABEL = "pagekeeper_remediate"
RUNBOOK_BASE = "docs/runbook.md"
BY = "by (namespace, pod, llmserver)"
ON = "on (namespace, pod, llmserver)"


def runbook_url(alert: str, base: str = RUNBOOK_BASE) -> str:
    """Link to the alert's section of the runbook (headings are the alert names)."""
    return f"{base}#{alert.lower()}"


def server_selector(name: str, namespace: str) -> str:
    return f'{{namespace="{namespace}", llmserver="{name}"}}'


def alert_rule(
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
