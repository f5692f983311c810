"""The one-shot all-reduce over peer-mapped (symmetric) memory, and when to use it over NCCL.

Every rank holds a buffer of `capacity_bytes` that all the other ranks of the host have mapped
(PyTorch's `torch.distributed._symmetric_memory`, CUDA backend, peer access over NVLink). To sum
`x`, each rank copies it into its own buffer and one kernel per rank waits at a barrier on the
buffers' signal pads, reads the same rows from every rank's buffer, writes their sum into `x`,
and meets the others at a second barrier, so that the next copy cannot overwrite a buffer a peer
is still reading. That is one launch and one trip across the links, against NCCL's fixed cost
per call, which dominates at the few rows of a decode step; at large messages every rank reading
every other rank's whole buffer loses to NCCL's ring. The buffer's address is fixed, so the copy
and the kernel are captured in CUDA graphs like any other kernels.

Which sizes go one-shot is measured at start-up (`time_all_reduces` on each rank, the slowest
rank's figure per size: `combine_rank_timings`) and decided by a pure function
(`choose_one_shot_max_bytes`), so that every rank takes the same path for the same message:
ranks that disagreed would wait in different collectives forever.

NVLink multicast stays off: a program that sets it up (cuMulticastCreate, PyTorch's multimem
operations) can put a shared host's GPUs out of service. The one-shot kernel needs only plain
peer loads, and `import_symmetric_memory` turns PyTorch's multicast set-up off before anything
of symmetric memory runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from pagekeeper_engine.kernels.graph_timing import best_replays, capture

# Read by PyTorch's CUDA symmetric-memory backend when it maps a buffer: with "1" the rendezvous
# maps peers' buffers only and never creates a multicast object.
DISABLE_MULTICAST = "TORCH_SYMM_MEM_DISABLE_MULTICAST"

# A buffer large enough for the decode steps' messages (up to 1024 rows of 4096 in bf16); past a
# few MiB each rank reading all the others' bytes loses to NCCL's ring on two or more GPUs.
DEFAULT_CAPACITY_BYTES = 8 * 2**20

CALLS_PER_GRAPH = 10  # all-reduces in one timed graph: a replay's launch cost is spread over them
NUM_WARM_UP_REPLAYS = 3
NUM_ROUNDS = 5  # timed replays of each path, interleaved so that clock drift hits both alike


@dataclass(frozen=True)
class AllReduceTiming:
    """One message size's all-reduce time by each path, in microseconds."""

    num_bytes: int
    nccl_us: float
    one_shot_us: float


@dataclass(frozen=True)
class AllReduceChoice:
    """Which all-reduces run one-shot: those of at most `one_shot_max_bytes` (0: none), with
    the timings behind it, or the reason the one-shot path is off."""

    one_shot_max_bytes: int
    timings: tuple[AllReduceTiming, ...] = ()
    off_reason: str | None = None

    def describe(self) -> str:
        if self.off_reason is not None:
            return f"NCCL for every size ({self.off_reason})"
        timed = ", ".join(
            f"{t.num_bytes} B: {t.one_shot_us:.1f} us one-shot / {t.nccl_us:.1f} us NCCL"
            for t in self.timings
        )
        return f"one-shot up to {self.one_shot_max_bytes} bytes, NCCL above ({timed})"


def timed_rows(capacity_bytes: int, hidden_size: int, itemsize: int) -> list[int]:
    """The row counts timed at start-up: 1, 2, 4, ... and the most rows the buffer holds."""
    max_rows = capacity_bytes // (hidden_size * itemsize)
    rows = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
    if rows and rows[-1] != max_rows:
        rows.append(max_rows)
    return rows


def combine_rank_timings(per_rank: Sequence[Sequence[AllReduceTiming]]) -> list[AllReduceTiming]:
    """Every rank's timings (in rank order) -> one per size, each path at its slowest rank's
    time: a collective ends when its last rank does."""
    sizes = [t.num_bytes for t in per_rank[0]]
    assert all([t.num_bytes for t in timings] == sizes for timings in per_rank), (
        f"the ranks timed different sizes: {[[t.num_bytes for t in ts] for ts in per_rank]}"
    )
    return [
        AllReduceTiming(
            num_bytes=same_size[0].num_bytes,
            nccl_us=max(t.nccl_us for t in same_size),
            one_shot_us=max(t.one_shot_us for t in same_size),
        )
        for same_size in zip(*per_rank, strict=True)
    ]


def choose_one_shot_max_bytes(timings: Sequence[AllReduceTiming]) -> int:
    """The largest size of the leading run, from the smallest size up, where one-shot is
    strictly faster; 0 when it loses (or ties) at the smallest. A win after a loss is taken for
    noise: the one-shot's cost grows with the bytes faster than NCCL's, so it does not win
    again, and one threshold keeps the choice a single comparison."""
    max_bytes = 0
    for timing in sorted(timings, key=lambda t: t.num_bytes):
        if timing.one_shot_us >= timing.nccl_us:
            break
        max_bytes = timing.num_bytes
    return max_bytes


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
    `all_reduce_` takes a tensor that `fits`, eagerly or under CUDA graph capture."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer  # (capacity,) of the model's dtype, mapped by every peer
        self.group_name = group_name

    @staticmethod
    def allocate(
        capacity_bytes: int, dtype: torch.dtype, device: torch.device, group_name: str
    ) -> OneShotAllReduce:
        """This rank's buffer, not yet mapped by the peers (a local step: it can fail on one
        rank alone, which the ranks must learn before the collective `rendezvous`)."""
        symm_mem = import_symmetric_memory()
        backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else "CUDA"
        if backend != "CUDA":
            # The CUDA backend's kernel is the one described above and the one that honours
            # DISABLE_MULTICAST; another backend (NVSHMEM, NCCL) is not set up here.
            raise RuntimeError(f"symmetric memory backend {backend}, not CUDA")
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError(f"torch {torch.__version__} has no one_shot_all_reduce_out")
        num_elements = capacity_bytes // dtype.itemsize
        # A normal tensor even when set up under inference mode: the steps write it inside
        # inference mode, the start-up checks may write it outside, and only a normal tensor
        # can be written in both.
        with torch.inference_mode(False):
            buffer = symm_mem.empty(num_elements, dtype=dtype, device=device)
        return OneShotAllReduce(buffer, group_name)

    def rendezvous(self) -> None:
        """Map every rank's buffer into every other rank (collective over the group)."""
        symm_mem = import_symmetric_memory()
        assert os.environ.get(DISABLE_MULTICAST) == "1", f"{DISABLE_MULTICAST} must be 1"
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can go one-shot: on this GPU, of the buffer's dtype, contiguous (the
        kernel writes its output as a flat array) and no larger than the buffer."""
        return (
            x.device == self.buffer.device
            and x.dtype == self.buffer.dtype
            and x.is_contiguous()
            and x.numel() <= self.buffer.numel()
        )

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks, in place; every rank calls it with the same shape."""
        staged = self.buffer[: x.numel()].view(x.shape)
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)


def check_sum(one_shot: OneShotAllReduce, rank: int, size: int, hidden_size: int) -> None:
    """One eager one-shot of a row of small integers against their known sum (exact in any
    float dtype): raises when the path gives a wrong answer."""
    buffer = one_shot.buffer
    x = torch.full((1, hidden_size), rank + 1, dtype=buffer.dtype, device=buffer.device)
    one_shot.all_reduce_(x)
    expected = size * (size + 1) // 2
    if not torch.equal(x, torch.full_like(x, expected)):
        found = (float(x.min()), float(x.max()))
        raise RuntimeError(f"the one-shot sum gave values in {found}, not {expected}")


def time_all_reduces(
    nccl_all_reduce_: Callable[[torch.Tensor], None],
    one_shot: OneShotAllReduce,
    rows: Sequence[int],
    hidden_size: int,
) -> list[AllReduceTiming]:
    """This rank's best time of each path on (rows, hidden_size) messages, in CUDA graphs as
    the decode steps run them. A collective: every rank passes the same rows, and the loops
    run a fixed number of times (a rank that ran one more all-reduce would wait forever)."""
    timings = []
    for num_rows in rows:
        # Zeros: repeated in-place sums stay zero instead of overflowing to inf.
        x = torch.zeros(
            num_rows, hidden_size, dtype=one_shot.buffer.dtype, device=one_shot.buffer.device
        )
        graphs = [
            capture(functools.partial(nccl_all_reduce_, x), CALLS_PER_GRAPH),
            capture(functools.partial(one_shot.all_reduce_, x), CALLS_PER_GRAPH),
        ]
        # By count alone: the graphs hold collectives (`best_replays`).
        nccl_s, one_shot_s = best_replays(graphs, NUM_ROUNDS, warm_up_rounds=NUM_WARM_UP_REPLAYS)
        nccl_us, one_shot_us = (t * 1e6 / CALLS_PER_GRAPH for t in (nccl_s, one_shot_s))
        timings.append(AllReduceTiming(x.numel() * x.element_size(), nccl_us, one_shot_us))
        del graphs
    return timings
