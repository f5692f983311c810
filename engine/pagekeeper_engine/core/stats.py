"""A snapshot of the engine's state and cumulative counters, read by /metrics.

Plain data: the server turns each field into the metric named in docs/engine.md, "Metrics".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class EngineStats:
    """State of the engine after its latest step. Counters (`*_total`-like) only grow.

    Blocks are GPU KV blocks, not counting the reserved null block. `kv_cache_usage` is used
    over usable blocks; blocks held only by the prefix cache count as free (they are reclaimed
    on demand). Prefix-cache queries and hits are in tokens.
    """

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # vllm:kv_cache_usage_perc, in [0, 1]
    num_gpu_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # registered in the prefix cache, in use or not
    num_cache_only_blocks: int  # held only by the prefix cache (bounded)
    kv_internal_fragmentation: float  # unused slots of partly filled blocks / allocated slots
    num_cpu_blocks: int
    num_swap_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prefix_cache_evictions: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_steps: int
    num_failed_steps: int  # steps whose runner raised; their requests failed
    num_batched_tokens_total: int
    num_prompt_tokens: int  # prompt tokens of requests that got their first token
    num_generation_tokens: int
    num_requests_success: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(FINISH_REASONS, 0))
    )
    # Seconds the loop spent collecting launched steps' tokens (asynchronous scheduling; 0
    # without it): under load, the host's idle share; near 0, the host sets the pace.
    device_wait_seconds: float = 0.0
    # Prompt tokens a prefix cache would have found while caching is off (`KVCacheManager`).
    prefix_cache_shadow_hits: int = 0
    # The host KV tier (`core.host_tier`): its blocks (0: none) and those in use, each
    # `host_block_bytes` over all ranks; blocks copied in, loaded back and pushed out; the
    # device seconds of the loads known to be done; the prompt tokens found there (part of
    # `prefix_cache_hits`); and prompt tokens no tier held any more when asked for again.
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0
    host_block_bytes: int = 0
    num_host_blocks_stored: int = 0
    num_host_blocks_loaded: int = 0
    num_host_blocks_evicted: int = 0
    kv_load_seconds: float = 0.0
    prefix_cache_host_hits: int = 0
    prefix_cache_evicted_misses: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
