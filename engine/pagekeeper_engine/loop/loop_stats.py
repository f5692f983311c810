"""What the step loop reports: its `/metrics` snapshot and the result of `/admin/defragment`.

Imports no torch. `snapshot` reads the scheduler's state, the loop's counters and what the loop
knows of device memory into one `messages.LoopStats`, in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pagekeeper_engine.core.protocols import AllocatorMonitorProtocol
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.loop.oom_recovery import OomRecovery
from pagekeeper_engine.memory.allocator import AllocatorStats, PeriodicReader
from pagekeeper_engine.messages import DefragmentResult, LoopStats


def snapshot(
    sched: Scheduler,
    oom: OomRecovery,
    allocator: AllocatorStats | None,
    *,
    num_steps: int,
    num_failed_steps: int,
    num_batched_tokens_total: int,
    num_prompt_tokens: int,
    num_generation_tokens: int,
    num_requests_success: Mapping[str, int],
    num_consecutive_failed_steps: int,
    device_wait_seconds: float,
    host_block_bytes: int = 0,
    kv_load_seconds: float = 0.0,
    grammar: GrammarTimings | None = None,
) -> LoopStats:
    """The loop's state now: the scheduler's queues and pools, its counters (passed in), the
    out-of-memory events and step budget of `oom`, and the newest `allocator` reading; the
    runner's `host_block_bytes` and `kv_load_seconds` complete the host tier's figures, and
    its `grammar` timings are structured output's."""
    kv = sched.kv
    host = kv.host
    pool = kv.pool
    cpu_pool = sched.cpu_pool
    return LoopStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_swapped=len(sched.swapped),
        kv_cache_usage=pool.num_used_blocks / pool.num_usable_blocks,
        num_gpu_blocks=pool.num_usable_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_cache_only_blocks=pool.num_evictable_blocks,
        kv_internal_fragmentation=kv.internal_fragmentation(sched.running),
        num_cpu_blocks=cpu_pool.num_usable_blocks if cpu_pool is not None else 0,
        num_swap_blocks_used=cpu_pool.num_used_blocks if cpu_pool is not None else 0,
        prefix_cache_queries=kv.num_prefix_queries,
        prefix_cache_hits=kv.num_prefix_hits,
        prefix_cache_shadow_hits=kv.num_prefix_shadow_hits,
        num_prefix_cache_evictions=pool.num_evictions,
        num_preemptions=sched.num_preemptions,
        num_swap_preemptions=sched.num_swap_preemptions,
        num_recompute_preemptions=sched.num_recompute_preemptions,
        num_steps=num_steps,
        num_failed_steps=num_failed_steps,
        num_batched_tokens_total=num_batched_tokens_total,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        num_requests_success=dict(num_requests_success),
        num_oom_events=dict(oom.num_events),
        step_token_budget=oom.budget.current,
        max_step_token_budget=oom.budget.ceiling,
        allocator=allocator,
        num_consecutive_failed_steps=num_consecutive_failed_steps,
        device_wait_seconds=device_wait_seconds,
        num_host_blocks=host.num_blocks if host is not None else 0,
        num_host_blocks_used=host.num_used_blocks if host is not None else 0,
        host_block_bytes=host_block_bytes,
        num_host_blocks_stored=host.num_stored if host is not None else 0,
        num_host_blocks_loaded=host.num_loaded if host is not None else 0,
        num_host_blocks_evicted=host.num_evicted if host is not None else 0,
        kv_load_seconds=kv_load_seconds,
        prefix_cache_host_hits=kv.num_prefix_host_hits,
        prefix_cache_evicted_misses=kv.num_evicted_misses,
        grammar=grammar if grammar is not None else GrammarTimings(),
    )


def release_cached(
    monitor: AllocatorMonitorProtocol, reader: PeriodicReader[AllocatorStats], num_running: int
) -> DefragmentResult:
    """Release the allocator's cached segments, reading it before and after. Call with no step
    in flight."""
    started = time.monotonic()
    before = reader.read_now()
    bytes_freed = monitor.release_cached()
    after = reader.read_now()
    return DefragmentResult(
        is_done=True,
        num_running=num_running,
        bytes_freed=bytes_freed,
        before=before,
        after=after,
        seconds=time.monotonic() - started,
    )
