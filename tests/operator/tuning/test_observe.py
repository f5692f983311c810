"""The window's PromQL: every series it reads is one the engine exports, and answers map onto
the window's numbers (absent series None, absent counts 0)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from pagekeeper_engine.frontend.metric_names import METRICS
from pagekeeper_operator.alerts.host import memory_limit, working_set_ratio
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.api.runtime import CLUSTER_SERIES
from pagekeeper_operator.tuning.observe import (
    Scope,
    build_window,
    p99_query,
    records_since,
    throughput_query,
    window_queries,
)

SCOPE = Scope("ml", "qwen")
SERIES = re.compile(r"([a-z_:]+)\{")


def series_read(promql: str) -> set[str]:
    names = set(SERIES.findall(promql))
    # A histogram is read through its buckets.
    return {n.removesuffix("_bucket") if n.endswith("_bucket") else n for n in names}


def test_every_series_read_is_exported_by_the_engine() -> None:
    queries = [
        *window_queries(SCOPE, 900, 256).values(),
        throughput_query(SCOPE, 600),
        p99_query(SCOPE, 600, "vllm:time_to_first_token_seconds"),
    ]
    read = set().union(*(series_read(q) for q in queries))
    # the host-memory figures are the cluster's (cAdvisor, kube-state-metrics, `up`)
    assert read <= set(METRICS) | set(CLUSTER_SERIES), read - set(METRICS)
    assert "pagekeeper_prefix_cache_shadow_hits_total" in read
    assert "pagekeeper_prefix_cache_evicted_misses_total" in read
    assert set(CLUSTER_SERIES) <= read


def test_the_host_figures_are_the_host_alerts() -> None:
    queries = window_queries(SCOPE, 900, 16)
    sel = '{namespace="ml",llmserver="qwen"}'
    assert queries["host_memory_ratio_peak"] == (
        f"max by (llmserver) (max_over_time(({working_set_ratio('ml', sel)})[900s:]))"
    )
    assert queries["memory_limit_bytes"] == f"max by (llmserver) ({memory_limit('ml', sel)})"
    assert queries["prefix_evicted_misses"] == (
        f"sum by (llmserver) (increase(pagekeeper_prefix_cache_evicted_misses_total{sel}[900s]))"
    )
    assert queries["kv_cache_bytes"] == (
        "max by (llmserver) (sum by (llmserver, pod) (pagekeeper_memory_budget_bytes"
        '{namespace="ml",llmserver="qwen",term="kv_cache"}))'
    )
    canary = window_queries(Scope("ml", "qwen", "qwen-canary-.*"), 900, 16)
    assert canary["kv_cache_bytes"].startswith("max by (pod) (sum by (pod) (")


def test_queries_select_the_server_and_aggregate_by_what_they_name() -> None:
    queries = window_queries(SCOPE, 900, 16)
    assert queries["prefix_hits"] == (
        'sum by (llmserver) (increase(vllm:prefix_cache_hits_total{namespace="ml",'
        'llmserver="qwen"}[900s]))'
    )
    assert queries["seq_cap_fraction"] == (
        "avg by (llmserver) (avg_over_time((vllm:num_requests_running"
        '{namespace="ml",llmserver="qwen"} >= bool 16)[900s:]))'
    )
    canary = Scope("ml", "qwen", "qwen-canary-.*")
    assert throughput_query(canary, 600) == (
        '(sum by (pod) (rate(vllm:generation_tokens_total{namespace="ml",llmserver="qwen",'
        'pod=~"qwen-canary-.*"}[37s])))[600s:37s]'
    )
    assert throughput_query(canary, 60).endswith("[5s])))[60s:5s]")


def test_answers_become_the_window() -> None:
    answers = {"vllm:kv_cache_usage_perc": 0.5, "vllm:request_success_total": 300.0}

    def query(promql: str, label: str) -> dict[str, float]:
        assert label in ("llmserver", "kind")
        if label == "kind":
            return {"step": 2.0}
        for name, value in answers.items():
            if name in promql and ("avg_over_time" in promql or "increase" in promql):
                return {"qwen": value, "other": 9.0}
        return {}

    window = build_window(query, SCOPE, 900, 256, extra={"num_fragmentation_alerts": 3})
    assert (window.kv_usage_avg, window.num_requests, window.seconds) == (0.5, 300.0, 900.0)
    assert (window.prefix_queries, window.prefix_shadow_hits, window.ttft_p99) == (0.0, None, None)
    assert (window.num_oom_step, window.num_oom_swap, window.num_fragmentation_alerts) == (
        2.0,
        0.0,
        3,
    )


def test_alerts_and_oom_terminations_in_the_window_come_from_status() -> None:
    def record(time: str, alert: str, action: str) -> RemediationRecord:
        return RemediationRecord(
            time=time, pod="p", alert=alert, action=action, outcome="applied", message=""
        )

    history = [
        record("2026-11-29T00:00:00Z", "PagekeeperFragmentationHigh", "evict"),
        record("2026-11-29T00:50:00Z", "PagekeeperFragmentationHigh", "evict"),
        record("2026-11-29T00:55:00Z", "gpu-runtime", "step-down"),
    ]
    now = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
    assert records_since(history, now, 900) == (1, 1)
