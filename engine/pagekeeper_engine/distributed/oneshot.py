"""The one-shot all-reduce over peer-mapped (symmetric) memory, and when to use it over NCCL.

Every rank holds a buffer that all the other ranks of the host have mapped (PyTorch's
`torch.distributed._symmetric_memory`, CUDA backend, peer access over NVLink): a staging region
of `capacity_bytes` and two slots of receiving regions, one per peer, that hold sentinels until a
peer's rows land, with a signal pad beside it. To sum `x`, each rank copies it into its staging
region and runs `kernels/peer_reduce.py` one of two ways: pushed, its programs store their rows
into every peer's receiving region and sum what lands in their own as it lands (one wait for the
peers); pulled, they meet the peers' at the signal pads, read every rank's staged rows, and meet
again before any buffer may be rewritten. A row-parallel projection can write its partial
sums straight into the buffer (`staged`) and have the sum added into the residual stream and
normed in the same launch (`StagedRows.reduce_add_norm_`): one kernel where a copy, the sum and
the norm were three. That is one trip across the links, against NCCL's fixed cost per call, which
dominates at the few rows of a decode step; at large messages every rank moving every other
rank's whole rows loses to NCCL's ring. The buffer's address is fixed, so the kernel is
captured in CUDA graphs like any other.

Which sizes go one-shot, and which way, is measured at start-up as the layers run them: the
fused launch pushed and pulled against NCCL's sum and the norm kernel (`time_all_reduces` on
each rank), and decided from every rank's timings by a pure function (`allreduce_choice`).

NVLink multicast stays off: a program that sets it up (cuMulticastCreate, PyTorch's multimem
operations) can put a shared host's GPUs out of service. The one-shot kernel needs only plain
peer loads, stores and atomics, and `import_symmetric_memory` turns PyTorch's multicast set-up
off before anything of symmetric memory runs.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from pagekeeper_engine.distributed.allreduce_choice import AllReduceTiming, OneShotWay
from pagekeeper_engine.kernels.graph_timing import best_replays, capture

if TYPE_CHECKING:  # the kernel module imports triton: loaded when a GPU group first needs it
    from pagekeeper_engine.kernels.peer_reduce import PeerBuffers

# Read by PyTorch's CUDA symmetric-memory backend when it maps a buffer: with "1" the rendezvous
# maps peers' buffers only and never creates a multicast object.
DISABLE_MULTICAST = "TORCH_SYMM_MEM_DISABLE_MULTICAST"

# A buffer large enough for the decode steps' messages (up to 1024 rows of 4096 in bf16); past a
# few MiB each rank reading all the others' bytes loses to NCCL's ring on four GPUs.
DEFAULT_CAPACITY_BYTES = 8 * 2**20
ONE_SHOT_WAYS: tuple[OneShotWay, ...] = ("push", "pull")
# The most a push launch sums: pushing wins only the small messages (docs/benchmarks-archive.md,
# "small all-reduces pushed, larger ones pulled"), and each rank holds two receiving regions of it
# per peer.
PUSH_CAPACITY_BYTES = 8 * 2**20


def capacity_bytes(num_ranks: int, max_tokens: int, hidden_size: int, itemsize: int) -> int:
    """The one-shot buffer's size. At two ranks each reads one peer's rows, and the fused launch
    beat NCCL and the norm through 2,048 rows of 4,096 (docs/benchmarks-archive.md, "the sum, the
    residual add and the norm in one launch"): the buffer holds a whole step's rows, so that the
    prefill chunks' sums may go one-shot too (the start-up timing decides). At more ranks, the
    decode steps' messages."""
    if num_ranks == 2:
        return max(DEFAULT_CAPACITY_BYTES, max_tokens * hidden_size * itemsize)
    return DEFAULT_CAPACITY_BYTES


# The widest row one program of the kernel sums (the widest hidden size served is 16,384).
MAX_ROW_ELEMENTS = 16384

TIMING_EPS = 1e-6  # the timed norms' epsilon (their rows are zeros)
CALLS_PER_GRAPH = 10  # all-reduces in one timed graph: a replay's launch cost is spread over them
NUM_WARM_UP_REPLAYS = 3
NUM_ROUNDS = 5  # timed replays of each way, interleaved so that clock drift hits all alike


def import_symmetric_memory() -> ModuleType:
    """PyTorch's symmetric-memory module, with multicast off for this process and its children
    before any of its code runs. The variable is set whatever it held: a value inherited from
    the environment must not turn multicast on."""
    os.environ[DISABLE_MULTICAST] = "1"
    import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415 (only at size > 1)

    return symm_mem


class OneShotAllReduce:
    """The one-shot sum over the ranks of one group, through a symmetric buffer of fixed
    capacity. `allocate` and `rendezvous` are start-up steps that every rank takes together;
    then `all_reduce_` takes a tensor that `fits`, and `staged` gives rows to sum with the norm,
    eagerly or under CUDA graph capture, either way (`kernels/peer_reduce.py`)."""

    def __init__(
        self,
        memory: torch.Tensor,
        counts: torch.Tensor,
        staging: int,
        region: int,
        group_name: str,
    ) -> None:
        self.memory = memory  # every region, of the model's dtype, mapped by every peer
        self.buffer = memory[:staging]  # the staging region: what a rank sums
        self.counts = counts  # the kernel's push launch count, on this GPU
        self.staging = staging
        self.region = region  # elements a receiving region holds: the most a push sums
        self.group_name = group_name
        self.peers: PeerBuffers | None = None  # the ranks' mapped addresses, once rendezvoused

    @staticmethod
    def allocate(
        capacity_bytes: int, dtype: torch.dtype, device: torch.device, world: int, group_name: str
    ) -> OneShotAllReduce:
        """This rank's buffer (a staging region of `capacity_bytes` and its receiving regions,
        `kernels/peer_reduce.py`), cleared and not yet mapped by the peers (a local step: it can
        fail on one rank alone, which the ranks must learn before the collective `rendezvous`)."""
        from pagekeeper_engine.kernels.peer_reduce import (  # noqa: PLC0415 (triton)
            LAUNCH_COUNT_WORDS,
            PeerBuffers,
            buffer_elements,
        )

        symm_mem = import_symmetric_memory()
        backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else "CUDA"
        if backend != "CUDA":
            # The CUDA backend maps peers' buffers and signal pads for plain loads, stores and
            # atomics and honours DISABLE_MULTICAST; another backend (NVSHMEM, NCCL) is not set
            # up here.
            raise RuntimeError(f"symmetric memory backend {backend}, not CUDA")
        staging = capacity_bytes // dtype.itemsize
        region = min(capacity_bytes, PUSH_CAPACITY_BYTES) // dtype.itemsize
        # A normal tensor even when set up under inference mode: the steps write it inside
        # inference mode, the start-up checks may write it outside, and only a normal tensor
        # can be written in both.
        with torch.inference_mode(False):
            elements = buffer_elements(world, staging, region)
            memory = symm_mem.empty(elements, dtype=dtype, device=device)
            PeerBuffers.clear(memory, staging)
            counts = torch.zeros(LAUNCH_COUNT_WORDS, dtype=torch.int32, device=device)
        # Cleared before any peer can push: the peers push only after the rendezvous, which
        # this rank joins after this.
        torch.cuda.synchronize(device)
        return OneShotAllReduce(memory, counts, staging, region, group_name)

    def rendezvous(self) -> None:
        """Map every rank's buffer into every other rank (collective over the group), and keep
        the addresses the kernel reads them through."""
        from pagekeeper_engine.kernels.peer_reduce import PeerBuffers  # noqa: PLC0415 (triton)

        symm_mem = import_symmetric_memory()
        assert os.environ.get(DISABLE_MULTICAST) == "1", f"{DISABLE_MULTICAST} must be 1"
        handle = symm_mem.rendezvous(self.memory, self.group_name)
        rank, world = int(handle.rank), int(handle.world_size)
        buffer_ptrs, pad_ptrs = list(handle.buffer_ptrs), list(handle.signal_pad_ptrs)
        if buffer_ptrs[rank] != self.memory.data_ptr():
            raise RuntimeError("the mapped buffer does not start at this rank's tensor")
        device = self.memory.device
        # One program an SM at most: past that the meetings cost more than the rows they share
        # (docs/benchmarks-archive.md, "the sum, the residual add and the norm in one launch").
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        pad_programs = PeerBuffers.pad_programs(signal_pad_bytes(symm_mem), world)
        if pad_programs < 1:
            raise RuntimeError(f"a signal pad of {signal_pad_bytes(symm_mem)} bytes")
        self.peers = PeerBuffers(
            buffer=self.memory,
            buffer_ptrs=torch.tensor(buffer_ptrs, dtype=torch.int64, device=device),
            pad_ptrs=torch.tensor(pad_ptrs, dtype=torch.int64, device=device),
            counts=self.counts,
            rank=rank,
            world=world,
            staging=self.staging,
            region=self.region,
            max_programs=min(pad_programs, num_sms),
        )

    def fits(self, x: torch.Tensor, way: OneShotWay) -> bool:
        """Whether `x` can go one-shot `way`: on this GPU, contiguous (the kernel writes its
        output as rows of its last dimension) and of a shape that `fits_rows`."""
        return (
            x.device == self.buffer.device
            and x.is_contiguous()
            and x.dim() >= 1
            and self.fits_rows(x.numel() // max(1, x.shape[-1]), x.shape[-1], x.dtype, way)
        )

    def fits_rows(self, num_rows: int, dim: int, dtype: torch.dtype, way: OneShotWay) -> bool:
        """Whether (num_rows, dim) of `dtype` can go one-shot `way`: the buffer's dtype, rows no
        wider than one program holds, and no more values than the staging region (pulled) or
        a receiving region (pushed)."""
        return (
            dtype == self.buffer.dtype
            and dim <= MAX_ROW_ELEMENTS
            and num_rows * dim <= (self.region if way == "push" else self.staging)
        )

    def staged(self, num_rows: int, dim: int, way: OneShotWay) -> StagedRows:
        """This rank's staging region as (num_rows, dim) partial sums, for a projection to
        write and `StagedRows.reduce_add_norm_` to add up `way`."""
        peers = self.peers
        assert peers is not None, "rendezvous first"
        return StagedRows(peers.staged(num_rows, dim), peers, way)

    def all_reduce_(self, x: torch.Tensor, way: OneShotWay) -> None:
        """Sum `x` over the ranks, in place; every rank calls it with the same shape and way."""
        rows = x.view(-1, x.shape[-1])
        staged = self.staged(rows.shape[0], rows.shape[1], way)
        staged.rows.copy_(rows)
        push = way == "push"
        _kernel().peer_reduce(staged.peers, rows.shape[0], rows.shape[1], push=push, out=rows)


@dataclass(frozen=True)
class StagedRows:
    """A rank's (rows, dim) partial sums in its one-shot buffer (`rows`, where a row-parallel
    projection writes them), the ranks' buffers they are added up with, and which way."""

    rows: torch.Tensor
    peers: PeerBuffers
    way: OneShotWay

    def reduce_add_norm_(
        self, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
    ) -> None:
        """residual += the ranks' sum of their staged rows, and out = RMSNorm(residual) with
        `weight` and `eps`, in one launch; every rank calls it alike (a collective)."""
        num_rows, dim = self.rows.shape
        _kernel().peer_reduce(
            self.peers,
            num_rows,
            dim,
            push=self.way == "push",
            out=out,
            residual=residual,
            weight=weight,
            eps=eps,
        )


def _kernel() -> ModuleType:
    from pagekeeper_engine.kernels import peer_reduce  # noqa: PLC0415 (triton, on first use)

    return peer_reduce


def signal_pad_bytes(symm_mem: ModuleType) -> int:
    """The size of each buffer's signal pad, as PyTorch allocates it."""
    if hasattr(symm_mem, "get_signal_pad_size"):
        return int(symm_mem.get_signal_pad_size())
    return int(symm_mem._SymmetricMemory.signal_pad_size)


def check_sum(one_shot: OneShotAllReduce, rank: int, size: int, hidden_size: int) -> None:
    """One eager one-shot of a row of small integers each way against their known sum (exact
    in any float dtype): raises when a way gives a wrong answer."""
    buffer = one_shot.buffer
    expected = size * (size + 1) // 2
    for way in ONE_SHOT_WAYS:
        x = torch.full((1, hidden_size), rank + 1, dtype=buffer.dtype, device=buffer.device)
        one_shot.all_reduce_(x, way)
        if not torch.equal(x, torch.full_like(x, expected)):
            found = (float(x.min()), float(x.max()))
            raise RuntimeError(f"the one-shot sum ({way}) gave values in {found}, not {expected}")


def time_all_reduces(
    nccl_all_reduce_: Callable[[torch.Tensor], None],
    one_shot: OneShotAllReduce,
    rows: Sequence[int],
    hidden_size: int,
) -> list[AllReduceTiming]:
    """This rank's best time of each way on (rows, hidden_size) messages, in CUDA graphs as
    the decode steps run them: what a layer runs after a row-parallel projection, NCCL's sum
    then the residual-add norm kernel against the one-shot launch that does both, pushed (where
    the receiving regions hold it) and pulled. A collective: every rank passes the same rows,
    and the loops run a fixed number of times (a rank that ran one more all-reduce would wait
    forever)."""
    dtype, device = one_shot.buffer.dtype, one_shot.buffer.device
    weight = torch.ones(hidden_size, dtype=dtype, device=device)
    timings = []
    for num_rows in rows:
        # Zeros: repeated sums stay zero instead of overflowing to inf.
        x = torch.zeros(num_rows, hidden_size, dtype=dtype, device=device)
        residual = torch.zeros_like(x)
        ways = [w for w in ONE_SHOT_WAYS if one_shot.fits_rows(num_rows, hidden_size, dtype, w)]
        nccl_then_norm = functools.partial(_nccl_then_norm, nccl_all_reduce_, x, residual, weight)
        runs = [nccl_then_norm] + [
            functools.partial(
                one_shot.staged(num_rows, hidden_size, way).reduce_add_norm_,
                residual,
                weight,
                TIMING_EPS,
                x,
            )
            for way in ways
        ]
        graphs = [capture(run, CALLS_PER_GRAPH) for run in runs]
        # By count alone: the graphs hold collectives (`best_replays`).
        seconds = best_replays(graphs, NUM_ROUNDS, warm_up_rounds=NUM_WARM_UP_REPLAYS)
        nccl_us, *ways_us = (t * 1e6 / CALLS_PER_GRAPH for t in seconds)
        by_way = dict(zip(ways, ways_us, strict=True))
        timings.append(
            AllReduceTiming(
                x.numel() * x.element_size(),
                nccl_us,
                push_us=by_way.get("push", math.inf),
                pull_us=by_way.get("pull", math.inf),
            )
        )
        del graphs
    return timings


def _nccl_then_norm(
    nccl_all_reduce_: Callable[[torch.Tensor], None],
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """What a layer runs on the NCCL path: the sum, then the residual-add norm kernel."""
    from pagekeeper_engine.kernels.rms_norm import rms_norm  # noqa: PLC0415 (triton)

    nccl_all_reduce_(x)
    rms_norm(x, weight, TIMING_EPS, residual, out=x, summed=residual)
