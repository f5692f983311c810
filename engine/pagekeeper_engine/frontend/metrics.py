"""Prometheus metrics: engine state read at scrape time, latencies observed by the server.

Gauges, counters and histograms the engine core already keeps (the newest `LoopStats` it
sent) are read when Prometheus scrapes, so no step of the engine loop pays for exporting them.
Latency histograms are observed by the request handlers, which see each token leave. Allocator
figures come from the CUDA caching allocator, read by the step loop at most once a second (a
scrape never touches the allocator, whose lock the model's thread needs), and are absent on the
CPU (see `metric_names.CUDA_ONLY`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagekeeper_engine.core.stats import STEP_SECONDS_BUCKETS, DurationCounts, GrammarTimings
from pagekeeper_engine.frontend.metric_names import (
    FINISHED_REASONS,
    GRAMMAR_FILL_PARTS,
    KV_BLOCK_STATES,
    METRICS,
    OOM_KINDS,
    PREFIX_CACHE_TIERS,
    REJECT_REASONS,
)
from pagekeeper_engine.memory.allocator import REPORTED_OPTIONS, AllocatorSettings, AllocatorStats
from pagekeeper_engine.messages import LoopStats, Ready

logger = logging.getLogger(__name__)

# Bucket edges in seconds: from a fast GPU decode step to a long queue under overload.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def _desc(name: str) -> str:
    return f"{name} ({METRICS[name][0]})"


def _buckets(durations: DurationCounts) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets of `durations`, the last at +Inf."""
    bounds = [*map(floatToGoString, STEP_SECONDS_BUCKETS), "+Inf"]
    return list(zip(bounds, itertools.accumulate(durations.counts), strict=True))


class EngineCollector(Collector):
    """Builds the engine's gauges and counters from one `LoopStats` read per scrape.

    `allocator_settings` (the allocator configuration in effect) is exported as an info series
    whatever the device; `read_ready` gives the core's handshake once it is loaded (the start-up
    budget's terms and the KV cache's shape).
    """

    def __init__(
        self,
        model_name: str,
        read_stats: Callable[[], LoopStats | None],
        is_draining: Callable[[], bool],
        read_ready: Callable[[], Ready | None] | None = None,
        allocator_settings: AllocatorSettings | None = None,
    ) -> None:
        self._model_name = model_name
        self._read_stats = read_stats
        self._is_draining = is_draining
        self._read_ready = read_ready
        self._allocator_settings = allocator_settings

    def _gauge(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> Metric:
        extra = dict(labels or {})
        family = GaugeMetricFamily(name, _desc(name), labels=["model_name", *extra])
        family.add_metric([self._model_name, *extra.values()], value)
        return family

    def _counter(self, name: str, value: float) -> Metric:
        family = CounterMetricFamily(name, _desc(name), labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        yield self._gauge("pagekeeper_drain_state", 1.0 if self._is_draining() else 0.0)
        if self._allocator_settings is not None:
            yield self._allocator_info(self._allocator_settings)
        stats = self._read_stats()
        if stats is not None:  # None while the model is still loading
            yield from self._engine_metrics(stats)
            if stats.allocator is not None:
                yield from self._allocator_metrics(stats.allocator)
        ready = self._read_ready() if self._read_ready is not None else None
        if ready is not None:
            yield self._cache_config_info(ready)
        budgets = ready.memory_budget_bytes if ready is not None else None
        if budgets:
            name = "pagekeeper_memory_budget_bytes"
            family = GaugeMetricFamily(name, _desc(name), labels=["model_name", "term", "rank"])
            for rank, budget in enumerate(budgets):
                for term, num_bytes in sorted(budget.items()):
                    family.add_metric([self._model_name, term, str(rank)], num_bytes)
            yield family

    def _cache_config_info(self, ready: Ready) -> Metric:
        name = "vllm:cache_config_info"
        labels = {
            "block_size": str(ready.block_size),
            "num_gpu_blocks": str(ready.num_gpu_blocks),
            "num_cpu_blocks": str(ready.num_cpu_blocks),
            "cache_dtype": ready.kv_cache_dtype,
        }
        return self._gauge(name, 1.0, labels)

    def _allocator_info(self, settings: AllocatorSettings) -> Metric:
        name = "pagekeeper_allocator_config_info"
        labels = ["model_name", "variable", *REPORTED_OPTIONS]
        family = GaugeMetricFamily(name, _desc(name), labels=labels)
        values = [settings.options.get(option, "") for option in REPORTED_OPTIONS]
        family.add_metric([self._model_name, settings.variable, *values], 1.0)
        return family

    def _engine_metrics(self, stats: LoopStats) -> Iterator[Metric]:
        yield self._gauge("vllm:num_requests_running", stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", stats.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries_total", stats.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits_total", stats.prefix_cache_hits)
        yield self._counter(
            "pagekeeper_prefix_cache_shadow_hits_total", stats.prefix_cache_shadow_hits
        )
        yield self._counter("vllm:num_preemptions_total", stats.num_preemptions)
        yield self._counter("vllm:prompt_tokens_total", stats.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens_total", stats.num_generation_tokens)

        name = "vllm:request_success_total"
        successes = CounterMetricFamily(name, _desc(name), labels=["model_name", "finished_reason"])
        # Every reason is present from the start so rate() sees a zero, not a missing series.
        reasons = dict.fromkeys(FINISHED_REASONS, 0) | dict(stats.num_requests_success)
        for reason, count in sorted(reasons.items()):
            successes.add_metric([self._model_name, reason], count)
        yield successes

        name = "pagekeeper_kv_blocks"
        blocks = GaugeMetricFamily(name, _desc(name), labels=["model_name", "state"])
        # A partition of the usable blocks: `free` holds nothing, `used` is referenced by a
        # sequence, `cached` is held only by the prefix cache (the stats count it as free).
        num_cached = stats.num_cache_only_blocks
        counts = (stats.num_free_blocks - num_cached, stats.num_used_blocks, num_cached)
        for state, count in zip(KV_BLOCK_STATES, counts, strict=True):
            blocks.add_metric([self._model_name, state], count)
        yield blocks
        yield self._gauge(
            "pagekeeper_kv_internal_fragmentation_ratio", stats.kv_internal_fragmentation
        )
        yield self._gauge("pagekeeper_swap_blocks_used", stats.num_swap_blocks_used)

        name = "pagekeeper_oom_events_total"
        ooms = CounterMetricFamily(name, _desc(name), labels=["model_name", "kind"])
        # Every kind is present from the start, at 0, so increase() sees the first event.
        for kind, count in sorted(
            (dict.fromkeys(OOM_KINDS, 0) | dict(stats.num_oom_events)).items()
        ):
            ooms.add_metric([self._model_name, kind], count)
        yield ooms
        yield self._gauge("pagekeeper_step_token_budget", stats.step_token_budget)
        yield self._counter("pagekeeper_device_wait_seconds_total", stats.device_wait_seconds)
        yield from self._grammar_metrics(stats.grammar)
        yield self._counter("pagekeeper_kv_events_published_total", stats.num_kv_events_published)
        yield self._counter("pagekeeper_kv_events_dropped_total", stats.num_kv_events_dropped)
        yield from self._host_tier_metrics(stats)

    def _grammar_metrics(self, grammar: GrammarTimings) -> Iterator[Metric]:
        """Structured output's grammar work, per step with a schema (empty without one)."""
        for name, durations in (
            ("pagekeeper_grammar_queue_seconds", grammar.queue),
            ("pagekeeper_grammar_fill_seconds", grammar.fill),
            ("pagekeeper_grammar_wait_seconds", grammar.wait),
            ("pagekeeper_grammar_apply_seconds", grammar.apply),
        ):
            family = HistogramMetricFamily(name, _desc(name), labels=["model_name"])
            family.add_metric([self._model_name], _buckets(durations), durations.sum_seconds)
            yield family
        name = "pagekeeper_grammar_fill_part_seconds"
        parts = HistogramMetricFamily(name, _desc(name), labels=["model_name", "part"])
        by_part = (
            grammar.fill_device_wait,
            grammar.fill_accept,
            grammar.fill_bitmask,
            grammar.fill_host_ops,
        )
        for part, durations in zip(GRAMMAR_FILL_PARTS, by_part, strict=True):
            parts.add_metric([self._model_name, part], _buckets(durations), durations.sum_seconds)
        yield parts

    def _host_tier_metrics(self, stats: LoopStats) -> Iterator[Metric]:
        """The host KV tier's series, present (at 0 capacity) without a tier too."""
        block_bytes = stats.host_block_bytes
        yield self._gauge(
            "pagekeeper_kv_offload_bytes_used", stats.num_host_blocks_used * block_bytes
        )
        yield self._gauge(
            "pagekeeper_kv_offload_bytes_capacity", stats.num_host_blocks * block_bytes
        )
        yield self._counter(
            "pagekeeper_kv_offload_blocks_stored_total", stats.num_host_blocks_stored
        )
        yield self._counter(
            "pagekeeper_kv_offload_blocks_loaded_total", stats.num_host_blocks_loaded
        )
        yield self._counter(
            "pagekeeper_kv_offload_blocks_evicted_total", stats.num_host_blocks_evicted
        )
        yield self._counter(
            "pagekeeper_kv_offload_load_bytes_total", stats.num_host_blocks_loaded * block_bytes
        )
        yield self._counter("pagekeeper_kv_offload_load_seconds_total", stats.kv_load_seconds)
        name = "pagekeeper_prefix_cache_hits_by_tier_total"
        hits = CounterMetricFamily(name, _desc(name), labels=["model_name", "tier"])
        host_hits = stats.prefix_cache_host_hits
        by_tier = {"gpu": stats.prefix_cache_hits - host_hits, "host": host_hits}
        for tier in PREFIX_CACHE_TIERS:
            hits.add_metric([self._model_name, tier], by_tier[tier])
        yield hits
        yield self._counter(
            "pagekeeper_prefix_cache_evicted_misses_total", stats.prefix_cache_evicted_misses
        )

    def _allocator_metrics(self, allocator: AllocatorStats) -> Iterator[Metric]:
        yield self._gauge("pagekeeper_allocator_reserved_bytes", allocator.reserved)
        yield self._gauge("pagekeeper_allocator_allocated_bytes", allocator.allocated)
        yield self._gauge("pagekeeper_allocator_fragmentation_bytes", allocator.fragmentation)
        yield self._gauge(
            "pagekeeper_allocator_largest_free_segment_bytes", allocator.largest_free_block
        )
        yield self._counter("pagekeeper_allocator_alloc_retries_total", allocator.num_alloc_retries)


class ServerMetrics:
    """The registry one front end exports, and the histograms its handlers observe.

    With several front ends (`multiprocess_dir` set, and `PROMETHEUS_MULTIPROC_DIR` naming it
    before prometheus-client was imported), the histograms and counters of every front end
    live in files there and each scrape sums them, so whichever front end answers, /metrics is
    the whole server's. The engine's own series come from the core's stats, the same in every
    front end.
    """

    def __init__(
        self, model_name: str, collector: EngineCollector, multiprocess_dir: str | None = None
    ) -> None:
        # `*_created` samples double the series count and no alert or dashboard reads them.
        # The switch is process-wide; this process exports only this registry.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        if multiprocess_dir is not None:
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        # observed here, exported by the registry above (directly, or through the files)
        own = None if multiprocess_dir is not None else self.registry
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.",
            labels,
            registry=own,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive output tokens of one request.",
            labels,
            registry=own,
            buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last output token.",
            labels,
            registry=own,
            buckets=E2E_BUCKETS,
        ).labels(model_name)
        rejected = Counter(
            "pagekeeper_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["model_name", "reason"],
            registry=own,
        )
        self._rejected = {reason: rejected.labels(model_name, reason) for reason in REJECT_REASONS}

    def count_rejected(self, reason: str) -> None:
        self._rejected[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one sequence's latencies as its tokens leave the server."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None

    def on_tokens(self, num_new_tokens: int, now_s: float) -> None:
        if num_new_tokens <= 0:
            return
        if self._last_token_s is None:
            self._metrics.time_to_first_token.observe(now_s - self._arrival_s)
            num_gaps = num_new_tokens - 1  # tokens after the first in the same output
            gap_s = 0.0
        else:
            # Several tokens in one output (a stop-string hold-back released at once) share
            # the interval since the previous output.
            num_gaps = num_new_tokens
            gap_s = (now_s - self._last_token_s) / num_new_tokens
        for _ in range(num_gaps):
            self._metrics.inter_token_latency.observe(gap_s)
        self._last_token_s = now_s

    def on_finish(self, now_s: float) -> None:
        self._metrics.e2e_request_latency.observe(now_s - self._arrival_s)
