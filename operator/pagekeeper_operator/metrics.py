"""The operator's own Prometheus metrics, served on PAGEKEEPER_METRICS_PORT when it is set.

`pagekeeper_remediations_total{namespace, llmserver, alert, action, outcome}` counts every record
appended to an LLMServer's `status.remediationHistory` (evictions, skips, dry runs, step-downs):
the history keeps the details of the last few, the counter keeps the rate of all of them.
`pagekeeper_tuning_recommendation{namespace, llmserver, field, proposed, rule}` (the rule's
confidence) mirrors status.recommendations; `pagekeeper_tuning_decisions_total{namespace,
llmserver, reason}` counts the tuner's Events.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.tuning import Recommendation

REGISTRY = CollectorRegistry(auto_describe=True)

REMEDIATIONS = Counter(
    "pagekeeper_remediations",
    "Remediation records appended to LLMServer status, by alert, action and outcome.",
    ["namespace", "llmserver", "alert", "action", "outcome"],
    registry=REGISTRY,
)

TUNING_RECOMMENDATIONS = Gauge(
    "pagekeeper_tuning_recommendation",
    "The tuner's current recommendations (status.recommendations): the rule's confidence, by "
    "field, proposed value and rule; absent when there is none.",
    ["namespace", "llmserver", "field", "proposed", "rule"],
    registry=REGISTRY,
)
TUNING_DECISIONS = Counter(
    "pagekeeper_tuning_decisions",
    "The tuner's decisions, by Event reason: TuningRecommendation, TuningRecommendationDropped "
    "(its candidate does not fit), RecommendationAccepted; in Apply mode TuningTrialStarted, "
    "TuningTrialExtended (the window could not decide: judged again over a longer run), "
    "TuningPromoted (a win), TuningRolledBack (a loss or tie, a failed canary, a moved "
    "baseline), TuningTrialInconclusive (the extended trial could not decide either: rolled "
    "back, held off for a quarter as long), TuningTrialSkipped (the candidate does not fit).",
    ["namespace", "llmserver", "reason"],
    registry=REGISTRY,
)
# The label sets each server exported last, so a recommendation that went away is removed.
_EXPORTED: dict[tuple[str, str], set[tuple[str, str, str]]] = {}


def count_tuning(
    namespace: str,
    llmserver: str,
    recommendations: Sequence[Recommendation],
    decisions: Sequence[str],
) -> None:
    """Export a tuning step: the current recommendations and the decisions it made (the
    reasons of its Events)."""
    current = {(r.field, r.proposed, r.rule): r.confidence for r in recommendations}
    for gone in _EXPORTED.get((namespace, llmserver), set()) - current.keys():
        TUNING_RECOMMENDATIONS.remove(namespace, llmserver, *gone)
    for labels, confidence in current.items():
        TUNING_RECOMMENDATIONS.labels(namespace, llmserver, *labels).set(confidence)
    _EXPORTED[(namespace, llmserver)] = set(current)
    for reason in decisions:
        TUNING_DECISIONS.labels(namespace, llmserver, reason).inc()


def count_remediation(namespace: str, llmserver: str, record: RemediationRecord) -> None:
    REMEDIATIONS.labels(namespace, llmserver, record.alert, record.action, record.outcome).inc()


def serve_metrics(port: int) -> None:
    """Serve /metrics on every address of the pod, from a daemon thread."""
    start_http_server(port, addr="0.0.0.0", registry=REGISTRY)
