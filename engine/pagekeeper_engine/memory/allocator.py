"""The CUDA caching allocator, seen from outside: what it holds, what it wastes, how it is set.

`reserved - allocated` is memory the allocator holds but no tensor uses; the largest free block
inside reserved segments says whether a large allocation can still be served without asking CUDA
for more. A forward pass that needs a bigger block than that, when the device has no room left
for a new segment, is the fragmentation OOM this project exists to prevent.

Pure: no torch import, so the HTTP server can use these types before torch is loaded. The reads
themselves live in `memory.cuda`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

# torch >= 2.9 reads PYTORCH_ALLOC_CONF and falls back to the older CUDA-specific name.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# The options the memory policy sets (docs/memory-policy.md, allocator.*), exported as info
# labels.
REPORTED_OPTIONS = ("expandable_segments", "garbage_collection_threshold", "max_split_size_mb")

T = TypeVar("T")


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

    def as_dict(self) -> dict[str, int]:
        return {
            "reserved_bytes": self.reserved,
            "allocated_bytes": self.allocated,
            "fragmentation_bytes": self.fragmentation,
            "largest_free_block_bytes": self.largest_free_block,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator configuration in effect: which variable set it, and its options."""

    variable: str  # "" when neither variable is set (the allocator's defaults)
    options: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.variable:
            return "PyTorch defaults (neither PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF set)"
        text = ",".join(f"{k}:{v}" for k, v in self.options.items())
        return f"{self.variable}={text}"


def parse_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator options in effect, from PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF."""
    return dict(read_alloc_settings(env).options)


def read_alloc_settings(env: Mapping[str, str]) -> AllocatorSettings:
    """The first of ALLOC_CONF_VARS that is set, parsed; ValueError naming it if malformed.

    pagekeeper's operator sets both variables to the same value; a user may set either.
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
            return AllocatorSettings(var, options)
    return AllocatorSettings("")


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


class PeriodicReader(Generic[T]):
    """Calls `read` at most once per `interval_s`; `latest` is the newest reading (or None).

    The step loop calls `maybe_read` after every step; only one call a second reaches the
    allocator, so a step costs one clock read when nothing is due.
    """

    def __init__(
        self,
        read: Callable[[], T],
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert interval_s > 0.0, interval_s
        self._read = read
        self._interval_s = interval_s
        self._clock = clock
        self._next_at = float("-inf")
        self.latest: T | None = None
        self.num_reads = 0

    def maybe_read(self) -> T | None:
        now = self._clock()
        if now >= self._next_at:
            self.latest = self._read()
            self.num_reads += 1
            self._next_at = now + self._interval_s
        return self.latest

    def read_now(self) -> T:
        """Read regardless of the interval (after a defragmentation, say)."""
        value = self._read()
        self.latest = value
        self.num_reads += 1
        self._next_at = self._clock() + self._interval_s
        return value
