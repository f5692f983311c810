"""The collectives a tensor-parallel model runs, over `torch.distributed`.

One `TensorParallelGroup` per process: the device group (NCCL between GPUs, gloo on the CPU)
carries the forward pass's all-reduces, the logits' gather to rank 0 and the sampled tokens'
broadcast from it; a gloo group beside it carries start-up facts between the ranks' hosts (the
memory budgets). At size 1 every collective is a no-op and nothing of `torch.distributed` is
touched, so the single-GPU engine runs exactly as it did.

`local_only()` suspends the collectives: the batch-1 GEMV choice times each rank's own compute
that way (timed loops differ in length per rank, and a collective left waiting would hang).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# How long a collective waits for a peer before raising: long enough for a 70B checkpoint's
# load on a slow rank, and never the way a dead peer is noticed (`workers` watches processes).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


RENDEZVOUS_HOST = "127.0.0.1"  # the ranks of one engine share a host (one pod)


def serve_rendezvous(size: int) -> Any:
    """Rank 0's store on a free local port (`.port`), before the other ranks start."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        RENDEZVOUS_HOST,
        0,
        size,
        is_master=True,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
    )


def join_rendezvous(port: int, size: int) -> Any:
    """Another rank's handle on rank 0's store."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        RENDEZVOUS_HOST, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )


class TensorParallelGroup:
    """Rank `rank` of `size`; `device_group`/`cpu_group` are None at size 1."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size
        self.device_group: Any = None
        self.cpu_group: Any = None
        self._suspended = False

    @staticmethod
    def initialize(rank: int, size: int, store: Any, device: torch.device) -> TensorParallelGroup:
        """Join the ranks through `store` (`serve_rendezvous` on rank 0, `join_rendezvous` on
        the others) and build both groups; NCCL when `device` is a GPU."""
        group = TensorParallelGroup(rank, size)
        if size == 1:
            return group
        backend = "nccl" if device.type == "cuda" else "gloo"
        options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **options
        )
        group.device_group = dist.group.WORLD
        group.cpu_group = (
            dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
            if backend != "gloo"
            else dist.group.WORLD
        )
        return group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_active(self) -> bool:
        return self.size > 1 and not self._suspended

    @contextlib.contextmanager
    def local_only(self) -> Iterator[None]:
        """Run this rank's compute with every collective skipped (for timing, not serving)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks, in place."""
        if self.is_active:
            dist.all_reduce(x, group=self.device_group)

    def gather_rows(self, local: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
        """local (N, C) from every rank -> (N, size * C) on rank 0, rank r's columns at
        [r * C, (r + 1) * C), into `out` when given; None on the other ranks."""
        if not self.is_active:
            return local if out is None else out.copy_(local)
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_first else None
        dist.gather(local.contiguous(), parts, dst=0, group=self.device_group)
        if parts is None:
            return None
        return torch.cat(parts, dim=1, out=out) if out is not None else torch.cat(parts, dim=1)

    def broadcast_(self, x: torch.Tensor) -> None:
        """Every rank's `x` becomes rank 0's, in place."""
        if self.is_active:
            dist.broadcast(x, src=0, group=self.device_group)

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value` (picklable host data: start-up facts only), in rank order."""
        if self.size == 1:
            return [value]
        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.cpu_group)
        return values

    def destroy(self) -> None:
        """Leave the groups. Over gloo only: an NCCL communicator that captured CUDA graphs
        still reference can wait forever in its destruction, and the process's exit releases
        it anyway."""
        if self.size > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
