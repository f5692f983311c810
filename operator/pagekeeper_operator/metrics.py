"""The operator's own Prometheus metrics, served on PAGEKEEPER_METRICS_PORT when it is set.

`pagekeeper_remediations_total{namespace, llmserver, alert, action, outcome}` counts every record
appended to an LLMServer's `status.remediationHistory` (evictions, skips, dry runs, step-downs):
the history keeps the details of the last few, the counter keeps the rate of all of them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, start_http_server

from pagekeeper_operator.api.remediation import RemediationRecord

REGISTRY = CollectorRegistry(auto_describe=True)

REMEDIATIONS = Counter(
    "pagekeeper_remediations",
    "Remediation records appended to LLMServer status, by alert, action and outcome.",
    ["namespace", "llmserver", "alert", "action", "outcome"],
    registry=REGISTRY,
)


def count_remediation(namespace: str, llmserver: str, record: RemediationRecord) -> None:
    REMEDIATIONS.labels(namespace, llmserver, record.alert, record.action, record.outcome).inc()


def serve_metrics(port: int) -> None:
    """Serve /metrics on every address of the pod, from a daemon thread."""
    start_http_server(port, addr="0.0.0.0", registry=REGISTRY)
