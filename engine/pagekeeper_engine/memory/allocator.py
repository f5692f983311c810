"""The CUDA caching allocator, seen from outside: what it holds, what it wastes, how it is set.

`reserved - allocated` is memory the allocator holds but no tensor uses; the largest free block
inside reserved segments says whether a large allocation can still be served without asking CUDA
for more. A forward pass that needs a bigger block than that, when the device has no room left
for a new segment, is the fragmentation OOM this project exists to prevent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorStats:
    """One reading of the caching allocator, in bytes."""

    reserved: int
    allocated: int
    largest_free_block: int  # largest inactive block inside reserved segments (sampled)
    num_alloc_retries: int  # cudaMalloc retries after freeing the cache: fragmentation pressure
    num_ooms: int

    @property
    def fragmentation(self) -> int:
        return self.reserved - self.allocated


def parse_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator options in effect, from PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF.

    torch reads PYTORCH_ALLOC_CONF first in recent releases and the CUDA-specific name before
    that; pagekeeper sets both to the same value, and reports the first one that is set.
    """
    for var in ALLOC_CONF_VARS:
        text = env.get(var, "").strip()
        if text:
            options: dict[str, str] = {}
            for item in text.split(","):
                key, sep, value = item.partition(":")
                if not sep or not key.strip():
                    raise ValueError(f"{var}: cannot parse {item!r} (expected key:value)")
                options[key.strip()] = value.strip()
            return options
    return {}


def largest_free_block(segments: Iterable[Mapping[str, Any]]) -> int:
    """Largest inactive block in a `torch.cuda.memory_snapshot()` segment list."""
    largest = 0
    for segment in segments:
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, int(block["size"]))
    return largest


class SnapshotSampler:
    """Rate-limits the costly snapshot so it stays under `max_overhead` of elapsed time.

    After a snapshot that took d seconds, the next one waits at least d / max_overhead seconds
    (and at least `min_interval`), so sampling can never cost more than that share of the run.
    """

    def __init__(
        self,
        take: Callable[[], int],
        max_overhead: float = 0.01,
        min_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert 0.0 < max_overhead < 1.0, max_overhead
        self._take = take
        self._max_overhead = max_overhead
        self._min_interval = min_interval
        self._clock = clock
        self._next_at = float("-inf")
        self.value = 0
        self.num_samples = 0
        self.seconds_spent = 0.0

    def maybe_sample(self) -> int:
        now = self._clock()
        if now >= self._next_at:
            self.value = self._take()
            done = self._clock()
            spent = done - now
            self.seconds_spent += spent
            self.num_samples += 1
            self._next_at = done + max(self._min_interval, spent / self._max_overhead)
        return self.value


def _snapshot_largest_free(device: torch.device) -> int:
    return largest_free_block(torch.cuda.memory_snapshot())  # type: ignore[no-untyped-call]


class CudaAllocatorMonitor:
    """Reads allocator statistics for one device; the snapshot part is rate-limited."""

    def __init__(self, device: torch.device, max_overhead: float = 0.01) -> None:
        self.device = device
        self.sampler = SnapshotSampler(lambda: _snapshot_largest_free(device), max_overhead)
        self.settings = parse_alloc_conf(os.environ)

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
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)
