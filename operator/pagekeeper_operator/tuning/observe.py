"""A server's metric window from Prometheus (the tuner's only I/O), and per-pod samples for a
canary trial.

`window_queries` is pure: one PromQL instant query per window number, each aggregated `by` one
label (`llmserver` for the server, `pod` for one pod) so the answer names what it measured. A
query with no answer leaves its number None (the runtime does not export the series), or 0 for
counts. Alerts and OOM terminations come from status (remediation's records), not Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pagekeeper_operator.adapters.prometheus import query_by, query_samples
from pagekeeper_operator.alerts.host import memory_limit, working_set_ratio
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.policy.adaptive import StuckClassification
from pagekeeper_operator.tuning.window import MetricWindow

FRAGMENTATION_ALERT = "PagekeeperFragmentationHigh"
# A trial's window gives each pod SAMPLES_PER_WINDOW throughput samples (compare.MIN_SAMPLES
# needs 8 a side), each a rate over its own step so that no two overlap; the scrape interval
# must be at most half the step (15 s for the default 15-minute window gives a 56 s step).
SAMPLES_PER_WINDOW = 16
MIN_SAMPLE_STEP_SECONDS = 5

Query = Callable[[str, str], dict[str, float]]  # (promql, label) -> label value -> value


@dataclass(frozen=True)
class Scope:
    """Whose series: a server's (by llmserver) or some of its pods' (by pod)."""

    namespace: str
    server: str
    pod_regex: str | None = None

    @property
    def selector(self) -> str:
        pods = f',pod=~"{self.pod_regex}"' if self.pod_regex is not None else ""
        return f'{{namespace="{self.namespace}",llmserver="{self.server}"{pods}}}'

    @property
    def by(self) -> str:
        return "pod" if self.pod_regex is not None else "llmserver"


def window_queries(scope: Scope, seconds: int, max_num_seqs: int) -> dict[str, str]:
    """MetricWindow field -> PromQL (see the module docstring)."""
    sel, w, by = scope.selector, f"[{seconds}s]", f"by ({scope.by})"

    def counter(name: str) -> str:
        return f"sum {by} (increase({name}{sel}{w}))"

    def quantile(name: str) -> str:
        return f"histogram_quantile(0.99, sum by ({scope.by}, le) (rate({name}_bucket{sel}{w})))"

    def term(name: str) -> str:
        return f'max {by} (pagekeeper_memory_budget_bytes{{{sel[1:-1]},term="{name}"}})'

    running = f"vllm:num_requests_running{sel}"
    # The host-memory alert's own figures (`alerts.host`), peaked over the window.
    ratio = working_set_ratio(scope.namespace, sel)
    pods = "pod" if scope.by == "pod" else "llmserver, pod"
    return {
        "num_requests": counter("vllm:request_success_total"),
        "output_tokens_per_s": f"sum {by} (rate(vllm:generation_tokens_total{sel}{w}))",
        "prompt_tokens": counter("vllm:prompt_tokens_total"),
        "kv_usage_avg": f"avg {by} (avg_over_time(vllm:kv_cache_usage_perc{sel}{w}))",
        "kv_usage_peak": f"max {by} (max_over_time(vllm:kv_cache_usage_perc{sel}{w}))",
        "num_preemptions": counter("vllm:num_preemptions_total"),
        "waiting_avg": f"avg {by} (avg_over_time(vllm:num_requests_waiting{sel}{w}))",
        "waiting_peak": f"max {by} (max_over_time(vllm:num_requests_waiting{sel}{w}))",
        "running_avg": f"avg {by} (avg_over_time({running}{w}))",
        "running_peak": f"max {by} (max_over_time({running}{w}))",
        "seq_cap_fraction": (
            f"avg {by} (avg_over_time(({running} >= bool {max_num_seqs})[{seconds}s:]))"
        ),
        "prefix_queries": counter("vllm:prefix_cache_queries_total"),
        "prefix_hits": counter("vllm:prefix_cache_hits_total"),
        "prefix_shadow_hits": counter("pagekeeper_prefix_cache_shadow_hits_total"),
        # Waste only means something while blocks are in use: idle samples (0) are left out.
        "kv_waste_avg": (
            f"avg {by} (avg_over_time((pagekeeper_kv_internal_fragmentation_ratio{sel}"
            f" and vllm:kv_cache_usage_perc{sel} > 0)[{seconds}s:]))"
        ),
        "reserved_peak_bytes": (
            f"max {by} (max_over_time(pagekeeper_allocator_reserved_bytes{sel}{w}))"
        ),
        "fragmentation_peak_bytes": (
            f"max {by} (max_over_time(pagekeeper_allocator_fragmentation_bytes{sel}{w}))"
        ),
        "ttft_p99": quantile("vllm:time_to_first_token_seconds"),
        "itl_p99": quantile("vllm:inter_token_latency_seconds"),
        "gpu_total_bytes": term("total"),
        "budget_allowed_bytes": term("allowed"),
        "fragmentation_buffer_bytes": term("fragmentation_buffer"),
        "kv_cache_bytes": (
            f"max {by} (sum by ({pods}) "
            f'(pagekeeper_memory_budget_bytes{{{sel[1:-1]},term="kv_cache"}}))'
        ),
        "prefix_evicted_misses": counter("pagekeeper_prefix_cache_evicted_misses_total"),
        "host_memory_ratio_peak": f"max {by} (max_over_time(({ratio})[{seconds}s:]))",
        "memory_limit_bytes": f"max {by} ({memory_limit(scope.namespace, sel)})",
    }


OOM_QUERY_FIELDS = {"step": "num_oom_step", "swap": "num_oom_swap", "startup": "num_oom_startup"}
# Counts that are 0, not unknown, when no series answers (nothing happened in the window).
_COUNTS = {"num_requests", "output_tokens_per_s", "prompt_tokens", "num_preemptions",
           "prefix_queries", "prefix_hits"}  # fmt: skip


def records_since(
    history: Sequence[RemediationRecord], now: datetime, seconds: int
) -> tuple[int, int]:
    """(fragmentation alerts, OOM terminations) remediation recorded in the window."""
    start = now - timedelta(seconds=seconds)
    alerts = ooms = 0
    for record in history:
        if record.time < start:
            continue
        alerts += record.alert == FRAGMENTATION_ALERT
        # every termination is recorded as a step-down; a stuck engine's is not memory's
        ooms += record.action == "step-down" and record.alert != StuckClassification.label
    return alerts, ooms


def build_window(
    query: Query,
    scope: Scope,
    seconds: int,
    max_num_seqs: int,
    *,
    key: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> MetricWindow:
    """The window of `scope` (or of the pod `key` within it) from `query`'s answers."""
    key = key or scope.server
    values: dict[str, Any] = {"seconds": float(seconds)}
    for field, promql in window_queries(scope, seconds, max_num_seqs).items():
        answer = query(promql, scope.by).get(key)
        values[field] = answer if answer is not None else (0.0 if field in _COUNTS else None)
    sel = scope.selector
    kinds = query(f"sum by (kind) (increase(pagekeeper_oom_events_total{sel}[{seconds}s]))", "kind")
    for kind, field in OOM_QUERY_FIELDS.items():
        values[field] = kinds.get(kind, 0.0)
    values.update(extra or {})
    return MetricWindow.from_dict(values)


def observe_server(
    url: str,
    namespace: str,
    server: str,
    seconds: int,
    max_num_seqs: int,
    extra: Mapping[str, Any] | None = None,
) -> MetricWindow:
    """A server's window from the Prometheus at `url`; raises PrometheusError."""

    def query(promql: str, label: str) -> dict[str, float]:
        return query_by(url, promql, label)

    return build_window(query, Scope(namespace, server), seconds, max_num_seqs, extra=extra)


def sample_step(seconds: int) -> int:
    return max(MIN_SAMPLE_STEP_SECONDS, seconds // SAMPLES_PER_WINDOW)


def num_samples(seconds: int) -> int:
    """How many samples a pod that served the whole window has."""
    return seconds // sample_step(seconds)


def throughput_query(scope: Scope, seconds: int) -> str:
    """Per-pod output tokens/s, SAMPLES_PER_WINDOW samples over the window."""
    step = f"{sample_step(seconds)}s"
    rate = f"rate(vllm:generation_tokens_total{scope.selector}[{step}])"
    return f"(sum by (pod) ({rate}))[{seconds}s:{step}]"


def pod_samples(url: str, scope: Scope, seconds: int) -> dict[str, list[float]]:
    """Pod -> its throughput samples over the window (for the canary's comparison)."""
    return query_samples(url, throughput_query(scope, seconds), "pod")


def p99_query(scope: Scope, seconds: int, histogram: str) -> str:
    """One p99 over every pod of `scope` (the canary's together, the baseline's together)."""
    rate = f"rate({histogram}_bucket{scope.selector}[{seconds}s])"
    return f"histogram_quantile(0.99, sum by (namespace, le) ({rate}))"


def scope_p99(url: str, scope: Scope, seconds: int, histogram: str) -> float | None:
    return query_by(url, p99_query(scope, seconds, histogram), "namespace").get(scope.namespace)
