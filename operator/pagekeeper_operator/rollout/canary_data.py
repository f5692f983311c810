"""Whether the canary is watched: Prometheus's data for the canary pods, and what its absence
does to the analysis.

A canary is judged on memory alerts that Prometheus evaluates. With Prometheus away (down,
unreachable, or not scraping the canary pods) no alert can fire, and a clean analysis would mean
nothing. So where the operator knows the Prometheus that scrapes the pods
(`PAGEKEEPER_PROMETHEUS_URL`), each reconcile of an analysis asks it which canary pods it
scraped successfully (`up == 1`):

- every ready canary pod scraped: the canary has data. The analysis counts from the later of
  its start and the end of the last gap (`status.canary.dataSince`), so a gap's time never
  counts as clean time;
- otherwise (Prometheus unreachable, refused the query, or a ready canary pod not scraped): the
  canary holds (never promotes) from `status.canary.dataMissingSince`, and after the bound
  (`PAGEKEEPER_CANARY_NO_DATA_SECONDS`) it is taken back with `failedSignal: noData`.

Before every canary pod is ready nothing is expected of Prometheus, and no clock runs. Without
a Prometheus URL the canary is judged on pod status and the alerts remediation recorded alone.

`track_data` is pure; `observe_canary_data` is the one query.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from pagekeeper_operator.adapters.prometheus import PrometheusError, query_by
from pagekeeper_operator.api.rollout import CanaryStatus

NO_DATA_SIGNAL = "noData"
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class CanaryData:
    """What Prometheus answered about the canary pods: the pods it scraped successfully, or the
    error that kept it from answering."""

    scraped_pods: frozenset[str] = frozenset()
    error: str | None = None

    def missing(self, ready_pods: Collection[str]) -> str | None:
        """Why the ready canary pods lack data (None: they all have it)."""
        if self.error is not None:
            return f"Prometheus did not answer: {self.error[:MAX_ERROR_CHARS]}"
        unscraped = sorted(set(ready_pods) - self.scraped_pods)
        if unscraped:
            return f"Prometheus has no successful scrape of canary pod(s) {', '.join(unscraped)}"
        return None


def canary_up_query(namespace: str, server: str, canary_prefix: str) -> str:
    """Each canary pod's scrape health (1: its last scrape succeeded), by pod."""
    selector = f'namespace="{namespace}",llmserver="{server}",pod=~"{canary_prefix}.+"'
    return f"max by (pod) (up{{{selector}}})"


def observe_canary_data(url: str, namespace: str, server: str, canary_prefix: str) -> CanaryData:
    """Ask the Prometheus at `url`; its failure is data too (`error`), never raised."""
    try:
        health = query_by(url, canary_up_query(namespace, server, canary_prefix), "pod")
    except PrometheusError as exc:
        return CanaryData(error=str(exc))
    return CanaryData(scraped_pods=frozenset(pod for pod, up in health.items() if up >= 1))


def track_data(
    previous: CanaryStatus, data: CanaryData, ready_pods: Collection[str], now: datetime
) -> tuple[CanaryStatus, str | None]:
    """The analysis's record with this reconcile's data, and why data is missing (None: the
    canary has it). A gap starts `dataMissingSince` (kept while it lasts); data after a gap,
    or for the first time, starts `dataSince`."""
    reason = data.missing(ready_pods)
    if reason is None:
        if previous.data_since is not None and previous.data_missing_since is None:
            return previous, None
        return previous.model_copy(update={"data_since": now, "data_missing_since": None}), None
    if previous.data_missing_since is not None:
        return previous, reason
    return previous.model_copy(update={"data_missing_since": now, "data_since": None}), reason
