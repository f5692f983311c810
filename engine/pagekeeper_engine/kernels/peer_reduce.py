# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The one-shot all-reduce over peer-mapped buffers, optionally fused with the residual add and
RMSNorm that follow every row-parallel projection of a tensor-parallel layer.

Every rank holds a buffer that every other rank of the host has mapped (`distributed/oneshot.py`
sets it up), and a signal pad of 32-bit words beside it, equally mapped. A rank's row-parallel
projection writes its partial sums (rows, dim) straight into its own buffer; then one launch per
rank, with the same grid on every rank:

1. Program p meets program p of every rank (`_meet`): it adds 1 to word p * W + r of each
   rank's pad (r its own rank, W the ranks; release at system scope, so its rank's writes of the
   buffer before this kernel are visible to whoever acquires the word; the adds are not waited
   for), then waits until every word p * W + q of its own pad is at least 1 (acquire) and takes
   1 from each: every rank has reached the kernel, so every buffer holds its rank's rows. The
   words count meetings, so a fast rank may signal its next meeting before a slow one has
   taken the last; every meeting adds and takes one, so the pad is all zeros again after it,
   which is what lets a CUDA graph replay the kernel without host help.
2. It sums its rows over the ranks' buffers, in rank order (the same fp32 sum, bit for bit, on
   every rank), and rounds the sum to the buffer's dtype, as an all-reduce's output is.
3. With `norm`: residual += sum (rounded), and out = RMSNorm(residual) (`rms_norm.rms_norm_row`,
   the norm kernel's arithmetic); without: out = sum.
4. It meets the others again: no rank leaves the kernel, and so no rank's next projection
   overwrites its buffer, while a peer still reads the rows program p reads from it.

Against a copy into the buffer, PyTorch's one-shot kernel (24 programs whatever the size) and
the residual-add norm after it, this is one launch, as many programs as rows (up to the pad's
words), and no bytes written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, check_like, next_power_of_2
from pagekeeper_engine.kernels.rms_norm import rms_norm_row

SIGNAL_WORD_BYTES = 4


@triton.jit
def _meet(pads_ptr, program, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `program` of this rank meets the same program of every rank (module docstring)."""
    ranks = tl.arange(0, WORLD)
    pads = tl.load(pads_ptr + ranks).to(tl.pointer_type(tl.int32))  # (WORLD,) every rank's pad
    # Every thread's loads and stores so far come before the signal.
    tl.debug_barrier()
    # Fire and forget: one add per rank, in parallel, none waited for.
    tl.atomic_add(pads + program * WORLD + RANK, 1, sem="release", scope="sys")
    own = tl.load(pads_ptr + RANK).to(tl.pointer_type(tl.int32)) + program * WORLD + ranks
    while tl.min(tl.atomic_add(own, 0, sem="acquire", scope="sys"), axis=0) < 1:
        pass
    tl.atomic_add(own, -1, sem="relaxed", scope="sys")


@triton.jit
def _peer_reduce_kernel(
    buffers_ptr,  # (WORLD,) int64: each rank's buffer address, as this rank maps it
    pads_ptr,  # (WORLD,) int64: each rank's signal pad address
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    residual_row_stride,
    out_row_stride,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
):
    program = tl.program_id(0)
    _meet(pads_ptr, program, RANK, WORLD)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    for row in range(program.to(tl.int64), num_rows, tl.num_programs(0)):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):
            rows = tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype))
            # Uncached: the peers' rows were written after any earlier kernel read them.
            part = tl.load(rows + row * DIM + offs, mask=mask, other=0.0, cache_modifier=".cv")
            total += part.to(tl.float32)
        x = total.to(dtype)
        residual_row = residual_ptr + row * residual_row_stride + offs
        out_row = out_ptr + row * out_row_stride + offs
        if NORM:
            # fp32 sums of two half-precision values, rounded once: the half-precision add,
            # which the interpreter cannot run.
            residual = tl.load(residual_row, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            tl.store(residual_row, x, mask=mask)
            x = rms_norm_row(x, weight_ptr, offs, mask, eps, DIM)
        tl.store(out_row, x, mask=mask)
    _meet(pads_ptr, program, RANK, WORLD)


@dataclass(frozen=True)
class PeerBuffers:
    """What the kernel needs of the ranks' mapped memory: each rank's buffer and signal pad
    address as this rank maps them ((W,) int64 tensors on this rank's GPU), this rank's own
    buffer as a tensor, and how many programs the pads hold words for."""

    buffer: torch.Tensor  # (capacity,) this rank's buffer
    buffer_ptrs: torch.Tensor  # (W,) int64
    pad_ptrs: torch.Tensor  # (W,) int64
    rank: int
    world: int
    max_programs: int

    @staticmethod
    def pad_programs(pad_bytes: int, world: int) -> int:
        """The programs a pad of `pad_bytes` has a word for per rank."""
        return pad_bytes // (SIGNAL_WORD_BYTES * world)

    def staged(self, num_rows: int, dim: int) -> torch.Tensor:
        """This rank's buffer as (num_rows, dim): where its partial sums go."""
        assert num_rows * dim <= self.buffer.numel(), f"{num_rows} x {dim} exceeds the buffer"
        return self.buffer[: num_rows * dim].view(num_rows, dim)


def peer_reduce(
    peers: PeerBuffers,
    num_rows: int,
    dim: int,
    *,
    out: torch.Tensor,  # (num_rows, dim) of the buffer's dtype, unit last stride
    residual: torch.Tensor | None = None,  # (num_rows, dim): the norm's residual, in place
    weight: torch.Tensor | None = None,  # (dim,): the norm's weight; with a residual only
    eps: float = 0.0,
) -> None:
    """Sum every rank's staged (num_rows, dim) rows into `out`; or, with `residual` and
    `weight`, add the sum into `residual` and write RMSNorm(residual) to `out`. Every rank
    calls it with the same shapes (a collective)."""
    buffer = peers.buffer
    assert buffer.dtype in SUPPORTED_DTYPES, f"buffer dtype {buffer.dtype} is not supported"
    assert out.shape == (num_rows, dim), f"out shape {tuple(out.shape)} != ({num_rows}, {dim})"
    assert out.dtype == buffer.dtype, f"out is {out.dtype}, the buffer {buffer.dtype}"
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"
    check_device("out", out, buffer.device)
    assert num_rows * dim <= buffer.numel(), f"{num_rows} x {dim} exceeds the buffer"
    assert peers.buffer_ptrs.shape == (peers.world,) and peers.pad_ptrs.shape == (peers.world,)
    assert 0 <= peers.rank < peers.world, f"rank {peers.rank} of {peers.world}"
    assert peers.world & (peers.world - 1) == 0, f"{peers.world} ranks, not a power of two"
    norm = residual is not None
    assert norm == (weight is not None), "a norm takes both residual and weight"
    if residual is not None and weight is not None:
        check_like("residual", residual, out)
        assert weight.shape == (dim,), f"weight shape {tuple(weight.shape)} != ({dim},)"
        assert weight.dtype == out.dtype and weight.is_contiguous(), "weight: out's dtype, dense"
        check_device("weight", weight, out.device)
    if num_rows == 0:
        return
    assert peers.max_programs >= 1, "the signal pads hold no program's words"
    block = next_power_of_2(dim)
    _peer_reduce_kernel[(min(num_rows, peers.max_programs),)](
        peers.buffer_ptrs,
        peers.pad_ptrs,
        residual if residual is not None else out,
        weight if weight is not None else out,
        out,
        num_rows,
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        RANK=peers.rank,
        WORLD=peers.world,
        DIM=dim,
        BLOCK=block,
        NORM=norm,
        num_warps=min(16, max(1, block // 256)),
    )
