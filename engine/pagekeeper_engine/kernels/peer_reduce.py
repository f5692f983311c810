# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The one-shot all-reduce over peer-mapped buffers, optionally fused with the residual add and
RMSNorm that follow every row-parallel projection of a tensor-parallel layer, in two ways: a
rank pushes its rows to its peers (fewer waits: the smaller messages), or pulls theirs (the
larger ones); which way a size goes is measured at start-up (`distributed/oneshot.py`).

Every rank holds one buffer that every other rank of the host has mapped (W the ranks): its
staging region of `staging` elements, where its row-parallel projection writes its partial sums
(rows, dim), then two slots of W - 1 receiving regions of `region` elements each, one per peer
(the pushed sizes only: `region` may be smaller than `staging`); a rank's rows from peer s sit
in receiving region W - 1 - k of a slot, k = (this rank - s) mod W. Beside the buffer, a signal
pad of 32-bit words, equally mapped. Either way, each program sums its rows in rank order (the
same fp32 sum, bit for bit, on every rank) and rounds the sum to the buffer's dtype, as an
all-reduce's output is; with `norm`, residual += sum (rounded) and out = RMSNorm(residual)
(`rms_norm.rms_norm_row`); without, out = sum.

**Push.** Nothing signals arrival: a value's presence is the signal. Every receiving value that
holds no peer's value holds the sentinel, -0.0 (the sign bit alone); senders make their -0.0
values +0.0 first (the sum is the same), so a value that is not the sentinel is a peer's, and
the check is per value: the stores of a row may land in any order.
1. Each program reads its rows from the staging region and stores them into its receiving
   region of every peer's slot, waiting for nothing.
2. For each row it takes its own values from the staging region and each peer's from its own
   slot, re-reading (volatile) until no value of the row is the sentinel, then writes the
   sentinels back.
3. The last program to finish (a count of finished programs, itself reset) advances the launch
   count, whose parity picks the slot: push launches alternate between the two slots.
A rank's push launch n + 2 writes the slot that its launch n used, and it starts only after its
launch n + 1 has summed, which needed every peer's launch n + 1 rows, which every peer pushes
only after its launch n ended, sentinels written back and all. So no rank overwrites rows a
peer has not read, and no rank's sentinels overwrite a peer's next rows. The counts live on
each GPU and advance on it, so a CUDA graph replays the launch without host help; every rank
runs the same launches (a collective), so their counts agree.

**Pull.** Program p meets program p of every rank (`_meet`): it adds 1 to word p * W + r of
each rank's pad (r its own rank; release at system scope, so its rank's staged rows are visible
to whoever acquires the word), then waits until every word p * W + q of its own pad is at least
1 (acquire) and takes 1 from each: every rank has reached the launch, so every staging region
holds its rank's rows. The words count meetings, so a fast rank may signal its next meeting
before a slow one has taken the last, and the pad is all zeros again after each. It reads its
rows from every rank's staging region, and meets the others again before leaving: no rank's
next projection may overwrite its staging region while a peer still reads it. The grid is the
same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, check_like, next_power_of_2
from pagekeeper_engine.kernels.rms_norm import rms_norm_row

# Each dtype's integer of the same width, which its sentinel's bits (the sign bit alone) are
# compared in.
_BITS_DTYPES = {2: torch.int16, 4: torch.int32}
_TRITON_BITS = {torch.int16: tl.int16, torch.int32: tl.int32}
LAUNCH_COUNT_WORDS = 2  # push launches so far (their parity picks the slot), programs finished
SIGNAL_WORD_BYTES = 4


def sentinel_bits(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """The integer dtype of `dtype`'s width and the sentinel's value in it: -0.0's bits."""
    bits_dtype = _BITS_DTYPES[dtype.itemsize]
    return bits_dtype, -(1 << (8 * dtype.itemsize - 1))


def buffer_elements(world: int, staging: int, region: int) -> int:
    """A rank's buffer: the staging region, then two slots of a receiving region per peer."""
    return staging + 2 * (world - 1) * region


@triton.jit
def _without_sentinel(x, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """x with every -0.0 made +0.0: a pushed value is never the sentinel."""
    bits = x.to(BITS, bitcast=True)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)
    return bits.to(x.dtype, bitcast=True)


@triton.jit
def _has_sentinel(x, mask, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """Whether a value of x (within mask) is still the sentinel: a peer's value not yet in."""
    return tl.max(tl.where(mask & (x.to(BITS, bitcast=True) == SENTINEL), 1, 0), axis=0) > 0


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
    counts_ptr,  # (2,) int32: push launches so far, programs of this launch finished
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    staging,  # elements the staging region holds: where the receiving regions start
    region,  # elements a receiving region holds
    residual_row_stride,
    out_row_stride,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    PUSH: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
):
    program = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    region = region.to(tl.int64)
    own = tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype))
    first = program.to(tl.int64)
    launch = 0
    slot = 0
    if PUSH:
        launch = tl.load(counts_ptr, volatile=True)
        slot = staging.to(tl.int64) + (launch % 2).to(tl.int64) * (WORLD - 1) * region
        for row in range(first, num_rows, tl.num_programs(0)):
            rows = own + row * DIM + offs
            part = _without_sentinel(tl.load(rows, mask=mask, other=0.0), BITS, SENTINEL)
            for k in tl.static_range(1, WORLD):
                peer = tl.load(buffers_ptr + (RANK + k) % WORLD).to(tl.pointer_type(dtype))
                received = peer + slot + region * (WORLD - 1 - k) + row * DIM + offs
                tl.store(received, part, mask=mask)
    else:
        _meet(pads_ptr, program, RANK, WORLD)
    sentinels = tl.full([BLOCK], SENTINEL, BITS).to(dtype, bitcast=True)
    for row in range(first, num_rows, tl.num_programs(0)):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if PUSH:
                if source == RANK:
                    rows = own + row * DIM + offs
                    part = _without_sentinel(tl.load(rows, mask=mask, other=0.0), BITS, SENTINEL)
                else:
                    k = (RANK - source + WORLD) % WORLD
                    received = own + slot + region * (WORLD - 1 - k) + row * DIM + offs
                    part = tl.load(received, mask=mask, other=0.0, volatile=True)
                    while _has_sentinel(part, mask, BITS, SENTINEL):
                        part = tl.load(received, mask=mask, other=0.0, volatile=True)
                    tl.store(received, sentinels, mask=mask)
            else:
                staged = tl.load(buffers_ptr + source).to(tl.pointer_type(dtype))
                # Uncached: the peers' rows were written after any earlier launch read them.
                rows = staged + row * DIM + offs
                part = tl.load(rows, mask=mask, other=0.0, cache_modifier=".cv")
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
    if PUSH:
        # Every program has read the launch count above; the last one to finish advances it.
        finished = tl.atomic_add(counts_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if finished == tl.num_programs(0) - 1:
            tl.store(counts_ptr + 1, 0)
            tl.store(counts_ptr, launch + 1)
    else:
        _meet(pads_ptr, program, RANK, WORLD)


@dataclass(frozen=True)
class PeerBuffers:
    """What the kernel needs of the ranks' mapped memory: each rank's buffer and signal pad
    address as this rank maps them ((W,) int64 tensors on this rank's GPU), this rank's whole
    buffer as a tensor (`buffer_elements`, its receiving regions holding sentinels), its push
    launch count, and the most programs a launch runs (no more than the pads hold words
    for)."""

    buffer: torch.Tensor  # (buffer_elements(world, staging, region),) this rank's buffer
    buffer_ptrs: torch.Tensor  # (W,) int64
    pad_ptrs: torch.Tensor  # (W,) int64
    counts: torch.Tensor  # (LAUNCH_COUNT_WORDS,) int32, zeros before the first launch
    rank: int
    world: int
    staging: int  # elements: the most a launch sums
    region: int  # elements: the most a push launch sums
    max_programs: int

    @staticmethod
    def pad_programs(pad_bytes: int, world: int) -> int:
        """The programs a pad of `pad_bytes` has a word for per rank."""
        return pad_bytes // (SIGNAL_WORD_BYTES * world)

    @staticmethod
    def clear(buffer: torch.Tensor, staging: int) -> None:
        """Every receiving region of a rank's buffer to sentinels (before any peer pushes)."""
        bits_dtype, sentinel = sentinel_bits(buffer.dtype)
        buffer[staging:].view(bits_dtype).fill_(sentinel)

    def staged(self, num_rows: int, dim: int) -> torch.Tensor:
        """This rank's staging region as (num_rows, dim): where its partial sums go."""
        assert num_rows * dim <= self.staging, f"{num_rows} x {dim} exceeds the buffer"
        return self.buffer[: num_rows * dim].view(num_rows, dim)


def peer_reduce(
    peers: PeerBuffers,
    num_rows: int,
    dim: int,
    *,
    push: bool,  # push this rank's rows to the peers, or pull theirs
    out: torch.Tensor,  # (num_rows, dim) of the buffer's dtype, unit last stride
    residual: torch.Tensor | None = None,  # (num_rows, dim): the norm's residual, in place
    weight: torch.Tensor | None = None,  # (dim,): the norm's weight; with a residual only
    eps: float = 0.0,
) -> None:
    """Sum every rank's staged (num_rows, dim) rows into `out`; or, with `residual` and
    `weight`, add the sum into `residual` and write RMSNorm(residual) to `out`. Every rank
    calls it with the same shapes and way (a collective)."""
    buffer = peers.buffer
    assert buffer.dtype in SUPPORTED_DTYPES, f"buffer dtype {buffer.dtype} is not supported"
    assert out.shape == (num_rows, dim), f"out shape {tuple(out.shape)} != ({num_rows}, {dim})"
    assert out.dtype == buffer.dtype, f"out is {out.dtype}, the buffer {buffer.dtype}"
    assert out.stride(-1) == 1, "out must be contiguous in its last dimension"
    check_device("out", out, buffer.device)
    assert num_rows * dim <= (peers.region if push else peers.staging), (
        f"{num_rows} x {dim} exceeds the buffer"
    )
    expected = buffer_elements(peers.world, peers.staging, peers.region)
    assert buffer.numel() == expected, f"a buffer of {buffer.numel()}, not {expected} elements"
    assert peers.buffer_ptrs.shape == (peers.world,) and peers.pad_ptrs.shape == (peers.world,)
    assert peers.counts.shape == (LAUNCH_COUNT_WORDS,) and peers.counts.dtype == torch.int32
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
    assert peers.max_programs >= 1, "a launch runs at least one program"
    block = next_power_of_2(dim)
    bits_dtype, sentinel = sentinel_bits(buffer.dtype)
    _peer_reduce_kernel[(min(num_rows, peers.max_programs),)](
        peers.buffer_ptrs,
        peers.pad_ptrs,
        peers.counts,
        residual if residual is not None else out,
        weight if weight is not None else out,
        out,
        num_rows,
        peers.staging,
        peers.region,
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        RANK=peers.rank,
        WORLD=peers.world,
        DIM=dim,
        BLOCK=block,
        NORM=norm,
        PUSH=push,
        BITS=_TRITON_BITS[bits_dtype],
        SENTINEL=sentinel,
        num_warps=min(16, max(1, block // 256)),
    )
