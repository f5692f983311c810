"""A snapshot of the engine's state and cumulative counters, read by /metrics.

Plain data: the server turns each field into the metric named in docs/engine.md, "Metrics".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

FINISH_REASONS = ("stop", "length", "abort")
# Upper bounds (seconds) of the buckets of a step's host-side durations: from 0.1 ms (a step's
# grammar work for a few rows) to 50 ms (a step stalled ten times over), finest over 1-10 ms,
# where a step at 64 streams lies (3-8 ms on an H100).
STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0065,
    0.008, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05,
)  # fmt: skip


@dataclass(frozen=True)
class DurationCounts:
    """A histogram of durations: how many fell in each bucket of `STEP_SECONDS_BUCKETS` (at
    most its bound, above the bound before; not cumulative), then how many above the last
    bound, and the durations' sum in seconds."""

    counts: tuple[int, ...] = (0,) * (len(STEP_SECONDS_BUCKETS) + 1)
    sum_seconds: float = 0.0

    @property
    def num_observed(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class GrammarTimings:
    """Per structured step (one with a `json_schema` row), what its grammar work cost the host
    (`runner.structured_output`; nothing is observed for a step without a schema):
    - `queue`: from the launch handing the work over to the grammar thread starting it;
    - `fill`: the grammar thread's job, the sum of its parts: `fill_device_wait` (for the
      bitmask's last copy to the device, then for the previous step's sampled ids on the
      host), `fill_accept` (the matchers take their new tokens), `fill_bitmask` (xgrammar's
      batch fill) and `fill_host_ops` (the rest: the host bitmask's writes and its check for
      rows allowing nothing, Python);
    - `wait`: the step loop blocked on the filled masks when it samples the step;
    - `apply`: then, enqueuing the mask's copy to the device and its application."""

    queue: DurationCounts = DurationCounts()
    fill: DurationCounts = DurationCounts()
    fill_device_wait: DurationCounts = DurationCounts()
    fill_accept: DurationCounts = DurationCounts()
    fill_bitmask: DurationCounts = DurationCounts()
    fill_host_ops: DurationCounts = DurationCounts()
    wait: DurationCounts = DurationCounts()
    apply: DurationCounts = DurationCounts()


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
    grammar: GrammarTimings = GrammarTimings()  # the runner's, for structured output

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
