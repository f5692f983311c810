"""The host KV tier's bytes: pinned host blocks, and the copies between them and the device pool.

The scheduler decides every copy and the order they need (`core.kv_copies`); this module only
carries them out, on two side streams. The loads go at once, beside the step in flight, behind
the earlier steps' stores only; the stores wait for the forward passes already enqueued (the
blocks they store were computed there) and for the earlier steps' loads (a host block the LRU
hands to a new hash is read by its older load first); the late loads wait for both. The step's
forward pass waits at its `CopyFence` on these streams' events, and on nothing otherwise.

A host block is one contiguous run of (num_layers * 2, chunk) words, so a run of consecutive
host ids is one transfer. On a GPU the blocks pass through a staging buffer on the device
(`kernels.block_copy`), a few at a time, one half for each stream; on the CPU the copies are
plain indexing, done at once in the device's order. Under tensor parallelism each rank holds
its shard of every block and runs the same copies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import torch

from pagekeeper_engine.core.kv_copies import CopyFence, StepCopies
from pagekeeper_engine.kernels.block_copy import as_words, gather_blocks, scatter_blocks
from pagekeeper_engine.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from pagekeeper_memplan.budget import kv_offload_staging_blocks


def host_tier_blocks(size_gib: float, tp_size: int, bytes_per_block: int) -> int:
    """Host blocks of one rank: `--kv-offloading-size` GiB over all ranks, each holding its
    shard (`bytes_per_block`) of every block."""
    return int(size_gib * 2**30) // tp_size // bytes_per_block


def consecutive_runs(
    pairs: Sequence[tuple[int, int]], host_index: int
) -> Iterator[tuple[int, int]]:
    """(start, length) over `pairs` of the runs whose host ids (`pair[host_index]`) go up by 1."""
    start = 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i][host_index] != pairs[i - 1][host_index] + 1:
            yield start, i - start
            start = i


class HostKVPool:
    """`num_blocks` host blocks shaped as the device pool's blocks, and the copies to and from
    it (module docstring); `load_seconds` sums the device time of finished loads."""

    def __init__(self, device_pool: torch.Tensor, num_blocks: int) -> None:
        self.device = device_pool.device
        self.is_cuda = self.device.type == "cuda"
        self.pool_words = as_words(device_pool)  # (chunks, num_gpu_blocks, chunk)
        num_chunks, _, chunk = self.pool_words.shape
        self.host = torch.empty(
            (num_blocks, num_chunks, chunk), dtype=self.pool_words.dtype, pin_memory=self.is_cuda
        )
        self.bytes_per_block = self.host[0].numel() * self.host.element_size()
        self.load_seconds = 0.0
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        # the last event of each stream: every copy enqueued on it so far is done after it
        self._loaded: torch.cuda.Event | None = None
        self._stored: torch.cuda.Event | None = None
        if self.is_cuda:
            half = kv_offload_staging_blocks(self.bytes_per_block) // 2
            staging = torch.empty(
                (2 * half, num_chunks, chunk), dtype=self.pool_words.dtype, device=self.device
            )
            self.load_staging, self.store_staging = staging[:half], staging[half:]
            self.load_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.store_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @property
    def num_blocks(self) -> int:
        return self.host.shape[0]

    def issue(self, copies: StepCopies) -> None:
        """Enqueue one step's copies in the order `core.kv_copies` gives and have the current
        stream wait at the step's fence."""
        if not self.is_cuda:
            self._copy_now(copies)
            return
        main = torch.cuda.current_stream(self.device)
        loaded_before, stored_before = self._loaded, self._stored
        early: torch.cuda.Event | None = None
        if copies.loads:
            if stored_before is not None:
                self.load_stream.wait_event(stored_before)
            early = self._timed_load(copies.loads)
        if copies.stores:
            self.store_stream.wait_stream(main)
            if loaded_before is not None:
                self.store_stream.wait_event(loaded_before)
            with torch.cuda.stream(self.store_stream):
                self._store(copies.stores)
                self._stored = _recorded()
        if copies.late_loads:
            self.load_stream.wait_stream(main)
            if self._stored is not None:
                self.load_stream.wait_event(self._stored)
            self._timed_load(copies.late_loads)
        fence = copies.fence
        if fence is CopyFence.PREVIOUS:
            waits = [loaded_before, stored_before]
        elif fence is CopyFence.LOADS:
            assert early is not None, "a LOADS fence without early loads"
            waits = [early]  # behind the earlier steps' loads and stores on the load stream
        elif fence is CopyFence.ALL:
            waits = [self._loaded, self._stored]
        else:
            waits = []
        for event in waits:
            if event is not None:
                main.wait_event(event)
        self._collect_timings()

    def _timed_load(self, loads: Sequence[tuple[int, int]]) -> torch.cuda.Event:
        with torch.cuda.stream(self.load_stream):
            started = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            started.record()
            self._load(loads)
            ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ended.record()
        self._timings.append((started, ended))
        self._loaded = ended
        return ended

    def _copy_now(self, copies: StepCopies) -> None:
        self._load_now(copies.loads)
        if copies.stores:
            gpu_ids = torch.tensor([g for g, _ in copies.stores])
            host_ids = torch.tensor([h for _, h in copies.stores])
            self.host[host_ids] = gather_blocks_ref(self.pool_words, gpu_ids)
        self._load_now(copies.late_loads)

    def _load_now(self, loads: Sequence[tuple[int, int]]) -> None:
        if loads:
            host_ids = torch.tensor([h for h, _ in loads])
            gpu_ids = torch.tensor([g for _, g in loads])
            scatter_blocks_ref(self.host[host_ids], gpu_ids, self.pool_words)

    def _load(self, loads: Sequence[tuple[int, int]]) -> None:
        staging = self.load_staging
        for chunk in _chunks(loads, staging.shape[0]):
            for start, length in consecutive_runs(chunk, 0):
                first = chunk[start][0]
                staging[start : start + length].copy_(
                    self.host[first : first + length], non_blocking=True
                )
            scatter_blocks(staging, self._device_ids([g for _, g in chunk]), self.pool_words)

    def _store(self, stores: Sequence[tuple[int, int]]) -> None:
        staging = self.store_staging
        for chunk in _chunks(stores, staging.shape[0]):
            gather_blocks(self.pool_words, self._device_ids([g for g, _ in chunk]), staging)
            for start, length in consecutive_runs(chunk, 1):
                first = chunk[start][1]
                self.host[first : first + length].copy_(
                    staging[start : start + length], non_blocking=True
                )

    def _device_ids(self, block_ids: list[int]) -> torch.Tensor:
        # A fresh pinned tensor each time: the caching host allocator keeps it until the
        # stream's copy of it is done.
        ids = torch.tensor(block_ids, dtype=torch.int64).pin_memory()
        return ids.to(self.device, non_blocking=True)

    def _collect_timings(self) -> None:
        while self._timings and self._timings[0][1].query():  # type: ignore[no-untyped-call]
            started, ended = self._timings.popleft()
            self.load_seconds += started.elapsed_time(ended) / 1000.0


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _chunks(pairs: Sequence[tuple[int, int]], size: int) -> Iterator[Sequence[tuple[int, int]]]:
    for start in range(0, len(pairs), size):
        yield pairs[start : start + size]
