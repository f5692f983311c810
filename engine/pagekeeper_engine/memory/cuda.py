"""Reads of the CUDA caching allocator and of device memory: the one module of `memory` that
talks to CUDA. Everything it returns is plain data for the pure modules beside it."""

from __future__ import annotations

import torch

from pagekeeper_engine.memory.allocator import (
    AllocatorStats,
    SnapshotSampler,
    largest_free_block,
)


def _snapshot_largest_free(device: torch.device) -> int:
    segments = [
        segment
        for segment in torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        if segment.get("device") in (None, device.index)
    ]
    return largest_free_block(segments)


class CudaAllocatorMonitor:
    """Reads allocator statistics for one device; the snapshot part is rate-limited.

    `memory_stats` is a cheap counter read; `memory_snapshot` walks every segment and block
    under the allocator's lock, so it runs at most once per `SnapshotSampler` period. Call it from
    the thread that runs the model: a snapshot from another thread would stall its allocations.
    """

    def __init__(
        self, device: torch.device, max_overhead: float = 0.01, min_interval_s: float = 5.0
    ) -> None:
        self.device = device
        self.sampler = SnapshotSampler(
            lambda: _snapshot_largest_free(device), max_overhead, min_interval_s
        )

    def read(self) -> AllocatorStats:
        stats = torch.cuda.memory_stats(self.device)
        return AllocatorStats(
            reserved=int(stats.get("reserved_bytes.all.current", 0)),
            allocated=int(stats.get("allocated_bytes.all.current", 0)),
            largest_free_block=self.sampler.maybe_sample(),
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
        )

    def release_cached(self) -> int:
        """Return cached, unused segments to CUDA; the bytes of reserved memory released."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)


class CudaMemoryReader:
    """The device-memory figures the start-up profiler needs (`memory.profile.MemoryReader`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
