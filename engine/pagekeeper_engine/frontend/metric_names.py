"""The engine -> alerts half of the contract: every metric the engine exports, by kind.

Names are as PromQL sees them (counters end in `_total`; a histogram `h` is queried as
`h_bucket`, `h_sum`, `h_count`). This module imports nothing, so tests of the operator's alert
rules can check their expressions against it without importing the engine.
"""

from __future__ import annotations

from typing import Final, Literal

MetricKind = Literal["gauge", "counter", "histogram"]

# Every series carries the label `model_name`; extra labels are listed per metric.
METRICS: Final[dict[str, tuple[MetricKind, tuple[str, ...]]]] = {
    # Standard signals, named as vLLM names them so existing dashboards and autoscalers work.
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),  # a fraction in [0, 1], despite the name
    "vllm:prefix_cache_queries_total": ("counter", ()),  # tokens looked up
    "vllm:prefix_cache_hits_total": ("counter", ()),  # tokens found cached
    "vllm:num_preemptions_total": ("counter", ()),
    "vllm:request_success_total": ("counter", ("finished_reason",)),
    "vllm:prompt_tokens_total": ("counter", ()),
    "vllm:generation_tokens_total": ("counter", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    # 1 once loaded: the KV cache's shape, read by the inference gateway's endpoint picker
    "vllm:cache_config_info": (
        "gauge",
        ("block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype"),
    ),
    # What no other engine exports.
    "pagekeeper_kv_blocks": ("gauge", ("state",)),  # state: free | used | cached
    "pagekeeper_kv_internal_fragmentation_ratio": ("gauge", ()),
    # prompt tokens a prefix cache would have found while it is off (the tuner's evidence)
    "pagekeeper_prefix_cache_shadow_hits_total": ("counter", ()),
    "pagekeeper_swap_blocks_used": ("gauge", ()),
    "pagekeeper_drain_state": ("gauge", ()),  # 0 serving, 1 draining
    "pagekeeper_requests_rejected_total": ("counter", ("reason",)),
    "pagekeeper_oom_events_total": ("counter", ("kind",)),
    "pagekeeper_allocator_reserved_bytes": ("gauge", ()),
    "pagekeeper_allocator_allocated_bytes": ("gauge", ()),
    "pagekeeper_allocator_fragmentation_bytes": ("gauge", ()),  # reserved - allocated
    "pagekeeper_allocator_largest_free_segment_bytes": ("gauge", ()),
    "pagekeeper_allocator_alloc_retries_total": ("counter", ()),  # cudaMalloc retried after a flush
    # 1 per process: the allocator configuration in effect (PYTORCH_ALLOC_CONF or the older
    # PYTORCH_CUDA_ALLOC_CONF; `variable` is "" when neither is set), one label per option.
    "pagekeeper_allocator_config_info": (
        "gauge",
        ("variable", "expandable_segments", "garbage_collection_threshold", "max_split_size_mb"),
    ),
    # one series per term and tensor-parallel rank (rank "0" alone on one GPU)
    "pagekeeper_memory_budget_bytes": ("gauge", ("term", "rank")),
    # tokens per step now: --max-num-batched-tokens, or less while recovering from an OOM
    "pagekeeper_step_token_budget": ("gauge", ()),
    # seconds the step loop sat waiting for the device's sampled tokens (asynchronous
    # scheduling only): its rate under load is the host's idle share; near 0, the host, not
    # the device, sets the pace
    "pagekeeper_device_wait_seconds_total": ("counter", ()),
    # Structured output's grammar work on the host, one observation per step with a schema
    # (none for steps without one; `core.stats.GrammarTimings`): the launch's hand-over to the
    # grammar thread's start, that thread's job, its parts (summing to it), the step loop
    # blocked on the job's result when it samples the step, then the mask's copy and apply.
    "pagekeeper_grammar_queue_seconds": ("histogram", ()),
    "pagekeeper_grammar_fill_seconds": ("histogram", ()),
    "pagekeeper_grammar_fill_part_seconds": ("histogram", ("part",)),
    "pagekeeper_grammar_wait_seconds": ("histogram", ()),
    "pagekeeper_grammar_apply_seconds": ("histogram", ()),
    # The host KV tier (--kv-offloading-size), totals over the tensor-parallel ranks: its bytes
    # in use and its capacity, full blocks copied to it, loaded back, and pushed out of it
    # (least recently used first), the bytes loaded and the device seconds the loads took.
    "pagekeeper_kv_offload_bytes_used": ("gauge", ()),
    "pagekeeper_kv_offload_bytes_capacity": ("gauge", ()),
    "pagekeeper_kv_offload_blocks_stored_total": ("counter", ()),
    "pagekeeper_kv_offload_blocks_loaded_total": ("counter", ()),
    "pagekeeper_kv_offload_blocks_evicted_total": ("counter", ()),
    "pagekeeper_kv_offload_load_bytes_total": ("counter", ()),
    "pagekeeper_kv_offload_load_seconds_total": ("counter", ()),
    # prompt tokens the prefix cache found, by the tier that held them (gpu | host); their sum
    # is vllm:prefix_cache_hits_total
    "pagekeeper_prefix_cache_hits_by_tier_total": ("counter", ("tier",)),
    # prompt tokens of full blocks that were cached once, then evicted from every tier, and
    # requested again (recomputed): the evidence for a host tier, or a larger one
    "pagekeeper_prefix_cache_evicted_misses_total": ("counter", ()),
    # KV cache events (--kv-events-config) sent on the PUB socket, and dropped before it (the
    # publisher's queue was full, or a send failed); both 0 with events off
    "pagekeeper_kv_events_published_total": ("counter", ()),
    "pagekeeper_kv_events_dropped_total": ("counter", ()),
}

# Exported only where they mean something: the CUDA caching allocator, and a start-up budget
# measured on a GPU. On the CPU these series are absent rather than faked as zeros.
CUDA_ONLY: Final[frozenset[str]] = frozenset(
    {
        "pagekeeper_allocator_reserved_bytes",
        "pagekeeper_allocator_allocated_bytes",
        "pagekeeper_allocator_fragmentation_bytes",
        "pagekeeper_allocator_largest_free_segment_bytes",
        "pagekeeper_allocator_alloc_retries_total",
        "pagekeeper_memory_budget_bytes",
    }
)

FINISHED_REASONS: Final[tuple[str, ...]] = ("stop", "length", "abort")
KV_BLOCK_STATES: Final[tuple[str, ...]] = ("free", "used", "cached")
# Device out-of-memory events (`memory.oom.OOM_EVENT_KINDS`): inside a forward step and while
# swapping blocks (both recovered), and at start-up (the process exits; its series stays 0).
OOM_KINDS: Final[tuple[str, ...]] = ("step", "swap", "startup")
# Where a prefix-cache hit was found (`pagekeeper_prefix_cache_hits_by_tier_total`).
PREFIX_CACHE_TIERS: Final[tuple[str, ...]] = ("gpu", "host")
REJECT_REASONS: Final[tuple[str, ...]] = ("overloaded", "draining", "loading")
# The parts of the grammar thread's job (`pagekeeper_grammar_fill_part_seconds`): waiting for
# the device (the bitmask's last copy, the previous step's sampled ids), the matchers taking
# their tokens, xgrammar's batch fill of the bitmask, and the rest (the host bitmask's writes and
# its check for rows allowing nothing, Python).
GRAMMAR_FILL_PARTS: Final[tuple[str, ...]] = ("device_wait", "accept", "bitmask", "host_ops")


def family_name(name: str) -> str:
    """The name prometheus-client's parser gives a metric family (counters lose `_total`)."""
    kind, _ = METRICS[name]
    return name.removesuffix("_total") if kind == "counter" else name
