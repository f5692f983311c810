"""The collectives a tensor-parallel model runs, over `torch.distributed`.

One `TensorParallelGroup` per process: the device group (NCCL between GPUs, gloo on the CPU)
carries the forward pass's all-reduces, the sampling partials' all-gather and, for batches
that rank 0 samples alone, the logits' gather to it and the sampled tokens' broadcast from it;
a gloo group beside it carries start-up facts between the ranks' hosts (the memory budgets).
At size 1 nothing of `torch.distributed` is touched (a gather copies the rank's own rows), so
the single-GPU engine runs exactly as it did.

`local_only()` suspends the collectives: the batch-1 GEMV choice times each rank's own compute
that way (timed loops differ in length per rank, and a collective left waiting would hang).

On GPUs, `enable_one_shot` may move the small all-reduces from NCCL to the one-shot all-reduce
over symmetric memory (`oneshot`), pushed or pulled, up to sizes all ranks measured and agreed
on at start-up (`allreduce_choice`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from pagekeeper_engine.distributed.allreduce_choice import (
    AllReduceChoice,
    AllReduceTiming,
    OneShotWay,
    choose,
    combine_rank_timings,
    timed_rows,
)
from pagekeeper_engine.distributed.oneshot import (
    OneShotAllReduce,
    StagedRows,
    capacity_bytes,
    check_sum,
    time_all_reduces,
)

logger = logging.getLogger(__name__)

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
        self.device: torch.device | None = None  # this rank's, once initialized at size > 1
        self._suspended = False
        self.one_shot: OneShotAllReduce | None = None  # set up by `enable_one_shot`
        # Which sizes go one-shot, and which way: `enable_one_shot`'s choice, once made.
        self.one_shot_choice: AllReduceChoice | None = None

    @staticmethod
    def initialize(rank: int, size: int, store: Any, device: torch.device) -> TensorParallelGroup:
        """Join the ranks through `store` (`serve_rendezvous` on rank 0, `join_rendezvous` on
        the others) and build both groups; NCCL when `device` is a GPU."""
        group = TensorParallelGroup(rank, size)
        if size == 1:
            return group
        group.device = device
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
        """Sum `x` over the ranks, in place. The path depends only on facts every rank shares
        (the size, dtype and layout of `x`; the agreed threshold), so all ranks take the same."""
        if not self.is_active:
            return
        one_shot, way = self._one_shot_for(x.numel() * x.element_size())
        if one_shot is not None and way is not None and one_shot.fits(x, way):
            one_shot.all_reduce_(x, way)
        else:
            self._nccl_all_reduce_(x)

    def partial_rows(self, num_rows: int, dim: int, dtype: torch.dtype) -> StagedRows | None:
        """Where a row-parallel projection writes its (num_rows, dim) partial sums when the
        ranks add them up one-shot (rows of the one-shot buffer, which one launch adds up and
        norms: `StagedRows.reduce_add_norm_`); None when they go through `all_reduce_` instead
        (or there is nothing to sum). Every rank gets the same answer for the same shape."""
        if not self.is_active:
            return None
        one_shot, way = self._one_shot_for(num_rows * dim * dtype.itemsize)
        if one_shot is None or way is None or not one_shot.fits_rows(num_rows, dim, dtype, way):
            return None
        return one_shot.staged(num_rows, dim, way)

    def _one_shot_for(self, num_bytes: int) -> tuple[OneShotAllReduce | None, OneShotWay | None]:
        """The one-shot path and its way when a message of `num_bytes` takes it."""
        if self.one_shot is None or self.one_shot_choice is None:
            return None, None
        return self.one_shot, self.one_shot_choice.way(num_bytes)

    def enable_one_shot(
        self, capacity_bytes: int, hidden_size: int, dtype: torch.dtype
    ) -> AllReduceChoice:
        """Set up the one-shot all-reduce for (rows, `hidden_size`) tensors of `dtype` up to
        `capacity_bytes`, and send the sizes where it beat NCCL on every rank its way. A
        collective that every rank calls once at start-up with the same arguments, outside
        `local_only()` and before any CUDA graph captures an all-reduce. When a rank cannot
        set it up, every rank logs why and keeps NCCL for everything. No-op at size 1 and
        on the CPU. A later call (another runner on the same group, as the 2-GPU tests build)
        sets nothing up again: it gets the first call's choice (`_later_choice`)."""
        if self.size == 1:
            return AllReduceChoice(0, off_reason="a single rank")
        if self.device is None or self.device.type != "cuda":  # the same on every rank
            return AllReduceChoice(0, off_reason="not on GPUs")
        assert not self._suspended, "enable_one_shot times collectives: not under local_only()"
        if self.one_shot_choice is not None:
            return self._later_choice(self.one_shot_choice, dtype)
        rows = timed_rows(capacity_bytes, hidden_size, dtype.itemsize)
        one_shot, failure = self._set_up_one_shot(capacity_bytes, hidden_size, dtype, rows)
        if one_shot is None:
            choice = AllReduceChoice(0, off_reason=failure)
            self.one_shot_choice = choice
            logger.warning("tensor-parallel all-reduce: %s", choice.describe())
            return choice
        local = time_all_reduces(self._nccl_all_reduce_, one_shot, rows, hidden_size)
        per_rank = cast(list[list[AllReduceTiming]], self.all_gather_object(local))
        choice = choose(combine_rank_timings(per_rank))
        self.one_shot = one_shot
        self.one_shot_choice = choice
        logger.info("tensor-parallel all-reduce: %s", choice.describe())
        return choice

    def _later_choice(self, first: AllReduceChoice, dtype: torch.dtype) -> AllReduceChoice:
        """The choice for a later runner on this group (every rank makes the same calls, so
        none enters a collective here): the `first` runner's, whose buffer and thresholds route
        by bytes and fit any tensor of its dtype; a model of another dtype fits none of it."""
        choice = first
        if self.one_shot is not None and self.one_shot.buffer.dtype != dtype:
            choice = AllReduceChoice(
                0, off_reason=f"the group's one-shot buffer holds {self.one_shot.buffer.dtype}"
            )
        logger.info("tensor-parallel all-reduce (set up earlier): %s", choice.describe())
        return choice

    def _set_up_one_shot(
        self, capacity_bytes: int, hidden_size: int, dtype: torch.dtype, rows: list[int]
    ) -> tuple[OneShotAllReduce | None, str | None]:
        """The one-shot path mapped and checked on every rank, or None and the lowest failing
        rank's reason. Each step that can fail on one rank alone ends in a vote, so that no
        rank enters a collective (the rendezvous, a one-shot kernel's wait for its peers' rows)
        that a peer skips."""
        device = self.device
        assert device is not None, "set up on the GPU of an initialized group"
        if not rows:  # the same on every rank: no vote
            return None, f"{capacity_bytes} bytes hold no row of {hidden_size} x {dtype}"
        one_shot: OneShotAllReduce | None = None
        failure: str | None = None
        try:
            group_name = self.device_group.group_name
            one_shot = OneShotAllReduce.allocate(
                capacity_bytes, dtype, device, self.size, group_name
            )
        except Exception as exc:  # an old torch, no symmetric-memory backend
            failure = f"allocation: {exc!r}"
        failure = self._first_failure(failure)
        if failure is not None or one_shot is None:
            return None, failure
        failure = self._first_failure(_failure_of("rendezvous", one_shot.rendezvous))
        if failure is None:
            check = functools.partial(check_sum, one_shot, self.rank, self.size, hidden_size)
            failure = self._first_failure(_failure_of("check", check))
        return (one_shot, None) if failure is None else (None, failure)

    def _nccl_all_reduce_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.device_group)

    def _first_failure(self, failure: str | None) -> str | None:
        """The lowest rank's failure among every rank's `failure`, the same on every rank."""
        for rank, value in enumerate(self.all_gather_object(failure)):
            if value is not None:
                return f"rank {rank}: {value}"
        return None

    def gather_(self, out: torch.Tensor | None, local: torch.Tensor) -> None:
        """Every rank's `local` (contiguous) into rank 0's `out` (size, *local.shape), in rank
        order; the other ranks pass None."""
        if not self.is_active:
            assert out is not None, "one rank gathers into its own buffer"
            out[0].copy_(local)
            return
        assert local.is_contiguous(), "gathered rows must be contiguous"
        parts = None if out is None else list(out.unbind(0))
        assert (out is not None) == self.is_first, "rank 0 alone gathers into a buffer"
        dist.gather(local, parts, dst=0, group=self.device_group)

    def all_gather_(self, out: torch.Tensor, local: torch.Tensor) -> None:
        """Every rank's `local` (contiguous) into every rank's `out` (size, *local.shape),
        contiguous, in rank order."""
        assert out.is_contiguous() and local.is_contiguous(), "all-gathered rows: contiguous"
        assert out.shape == (self.size, *local.shape), (
            f"out {tuple(out.shape)} holds no {self.size} x {tuple(local.shape)}"
        )
        if not self.is_active:
            out[0].copy_(local)
            return
        # Flat: gloo gathers along the first dimension of a flat output only.
        dist.all_gather_into_tensor(out.view(-1), local.view(-1), group=self.device_group)

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


def choose_all_reduce(
    tp: TensorParallelGroup,
    is_disabled: bool,
    hidden_size: int,
    dtype: torch.dtype,
    max_tokens: int,
) -> AllReduceChoice:
    """The path of the ranks' all-reduces: NCCL alone under --disable-custom-all-reduce, else
    the one-shot path for the sizes every rank timed it faster (`TensorParallelGroup`), over a
    buffer sized for steps of up to `max_tokens` (`capacity_bytes`)."""
    if tp.size > 1 and is_disabled:  # the same flag on every rank: no collective to skip
        choice = AllReduceChoice(0, off_reason="--disable-custom-all-reduce")
        logger.info("tensor-parallel all-reduce: %s", choice.describe())
        return choice
    capacity = capacity_bytes(tp.size, max_tokens, hidden_size, dtype.itemsize)
    return tp.enable_one_shot(capacity, hidden_size, dtype)


def _failure_of(name: str, step: Callable[[], None]) -> str | None:
    """Why `step` raised on this rank, or None: what a rank votes with."""
    try:
        step()
    except Exception as exc:  # no peer access between the GPUs, a wrong sum: keep NCCL
        return f"{name}: {exc!r}"
    return None
