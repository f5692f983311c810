"""What the step loop reports: its `/metrics` snapshot and the result of `/admin/defragment`.

Imports no torch. `LoopStats` is `core.stats.EngineStats` (the scheduler's state and the loop's
counters) plus what the loop knows of device memory; `snapshot` reads it all in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.core.stats import EngineStats
from pagekeeper_engine.memory.allocator import AllocatorStats, PeriodicReader
from pagekeeper_engine.memory.oom import OOM_EVENT_KINDS
from pagekeeper_engine.memory.oom_recovery import OomRecovery
from pagekeeper_engine.protocols import AllocatorMonitorProtocol


@dataclass(frozen=True)
class LoopStats(EngineStats):
    """`EngineStats` plus what the step loop knows of memory: out-of-memory events by kind,
    the live step token budget, and the newest allocator reading (None on the CPU)."""

    num_oom_events: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(OOM_EVENT_KINDS, 0))
    )
    step_token_budget: int = 0
    max_step_token_budget: int = 0
    allocator: AllocatorStats | None = None


@dataclass(frozen=True)
class DefragmentResult:
    """What `/admin/defragment` reports. `is_done` False: too busy (nothing was released)."""

    is_done: bool
    num_running: int
    bytes_freed: int = 0
    before: AllocatorStats | None = None
    after: AllocatorStats | None = None
    seconds: float = 0.0


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
) -> LoopStats:
    """The loop's state now: the scheduler's queues and pools, its counters (passed in), the
    out-of-memory events and step budget of `oom`, and the newest `allocator` reading."""
    kv = sched.kv
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
