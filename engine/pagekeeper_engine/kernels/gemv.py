# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""y = x W^T (+ b) for one row of x: the projections of a batch-1 decode step, with the
elementwise steps around them folded in.

At batch 1 a projection is a matrix-vector product that reads the whole weight once, so its
time is the weight's bytes over memory bandwidth plus the ramp at either end. Each program owns
`block_n` output columns and walks the full K dimension in `block_k`-wide tiles, accumulating
the products elementwise in fp32 registers and reducing across K once, after the loop: no
cross-thread reduction inside the loop and no split-K partials to combine, so the loop body is
loads and fused multiply-adds only and the software pipeline keeps `num_stages` tiles in flight.

At batch 1 the small kernels between the projections cost as much as their bytes (1.4-2 us a
launch against a few hundred bytes of work), so the GEMV can take them in:

- `norm`: x is the residual stream and the GEMV first takes its RMSNorm (a pass over x, which
  every program reads anyway, for the statistic; then each tile normed, rounded and weighted as
  `kernels/rms_norm.py` does): the pre-attention and pre-MLP norms need no launch of their own.
- `Epilogue.ADD`: `out` is the residual stream and receives out + y (y rounded first, as a
  separate projection and the residual-add norm would): the o and down projections update the
  residual in place, each program its own columns. With `sum_squares_out` each program also
  writes the sum of the squares of the values it stored to its own fp32 entry: the partial sums
  of the statistic the next projection's norm needs. Given them as `RowNorm.sum_squares`, that
  GEMV adds them up (in one fixed order: the result does not vary from run to run) instead of
  every one of its programs passing over x before its first product.
- `Epilogue.SWIGLU`: W is the fused (2I, K) gate/up matrix; a program computes its columns of
  both halves and stores silu(gate) * up (`kernels/swiglu.py`'s arithmetic), so the (1, 2I)
  intermediate is never written.

With `pdl` (programmatic dependent launch, Hopper and later) the kernel lets the next kernel in
the stream start launching as soon as all of its own programs run, and it loads its first weight
tile before waiting for the previous kernel: weights do not depend on it, so the launch and the
first DRAM round trip overlap the previous kernel's tail. Everything that reads another kernel's
output, and every store, comes after the wait.

FP8 weights (`weight_scale` given): W is e4m3 with one fp32 scale per row (`model/fp8.py`).
The loop reads the e4m3 tiles (half the bytes of bf16) and multiplies them, widened to fp32,
by x as before; each column's sum is multiplied by its row's scale in the epilogue, before the
bias (for SWIGLU, the gate's and the up row's scales each on its own sum).

Arithmetic: products and sums in fp32, the result (plus bias) rounded once to the output dtype,
as cuBLAS does for a bf16/fp16 GEMM; the summation order differs, so results agree with
`torch.nn.functional.linear` to rounding, not bit for bit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import (
    FP8_WEIGHT_DTYPE,
    SUPPORTED_DTYPES,
    check_device,
    next_power_of_2,
)


@dataclass(frozen=True)
class GemvConfig:
    """One program's tile: `block_n` output columns, K walked `block_k` at a time."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        return f"{self.block_n}x{self.block_k}, {self.num_warps} warps"


# What the start-up choice tries against cuBLAS (`model/gemv_choice.py`): the two best of a sweep
# over block_n 2-16, block_k 256-1024, 4-8 warps and 1-4 stages on the Llama-3.1-8B projections on
# an H200 (docs/benchmarks-archive.md, "a batch-1 GEMV chosen at start-up"), and two wide tiles of
# 16,384 elements that hold a whole row of K <= 2,048 or 4,096, so that a program loads all of its
# weights before it waits for the kernel ahead (the Qwen3-0.6B's o and down projections: batch-1 ITL
# 0.778 -> 0.720 ms; docs/benchmarks-archive.md, "whole-row GEMV tiles"); and two 16-row tiles,
# which the 8B's fused layer with FP8 weights ran fastest on an H100 (gate/up 16 x 256, o and
# down 16 x 1,024; `benchmarks/layer_tiles.py`, docs/benchmarks.md, "Also measured", run 57).
CANDIDATES = (
    GemvConfig(8, 512),
    GemvConfig(8, 1024),
    GemvConfig(8, 2048, num_warps=8, num_stages=1),
    GemvConfig(4, 4096, num_warps=8, num_stages=1),
    GemvConfig(16, 256),
    GemvConfig(16, 1024, num_warps=8),
)


class Epilogue(enum.IntEnum):
    """What the GEMV does with y: store it, add it into `out`, or store silu(gate) * up."""

    STORE = 0
    ADD = 1
    SWIGLU = 2


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm the GEMV applies to x first: its (K,) weight and epsilon, and optionally the
    partial sums of x's squares, a (P,) fp32 tensor whose total is the statistic (a residual-
    adding GEMV's `sum_squares_out`); without them each program passes over x for it."""

    weight: torch.Tensor
    eps: float
    sum_squares: torch.Tensor | None = None


@triton.jit
def _weight_tile(w_ptrs, col_mask, k, offs_k, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    # The weight is read once: evict it first, so it does not push x out of the cache.
    if EVEN_K:
        if EVEN_N:
            return tl.load(w_ptrs, eviction_policy="evict_first")
        return tl.load(w_ptrs, mask=col_mask[:, None], other=0.0, eviction_policy="evict_first")
    w_mask = col_mask[:, None] & ((k + offs_k) < K)[None, :]
    return tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _input_tile(x_ptr, norm_w_ptr, k, offs_k, K, inv_rms, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """(BLOCK_K,) fp32: x's tile at k, normed and weighted as the RMSNorm kernel rounds it."""
    k_mask = (k + offs_k) < K
    if EVEN_K:
        x = tl.load(x_ptr + k + offs_k)
    else:
        x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0)
    if NORM:
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
        if EVEN_K:
            x = tl.load(norm_w_ptr + k + offs_k) * normed
        else:
            x = tl.load(norm_w_ptr + k + offs_k, mask=k_mask, other=0.0) * normed
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_w_ptr,
    y_ptr,  # the output; with EPILOGUE == ADD also the addend (the residual stream)
    sum_sq_in_ptr,  # NORM_GIVEN: partial sums of x's squares (fp32)
    sum_sq_out_ptr,  # SUM_SQUARES_OUT: one entry a program, its stored values' squares
    w_scale_ptr,  # W_SCALE: (rows,) fp32, one scale per weight row
    num_parts,  # NORM_GIVEN: entries of sum_sq_in_ptr
    N,  # output columns (I for SWIGLU, whose weight has 2I rows)
    K,
    w_row_stride,
    up_offset,  # SWIGLU: elements from a gate row to its up row (N rows on)
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    NORM_GIVEN: tl.constexpr,  # NORM with the statistic summed from sum_sq_in_ptr
    PARTS_PAD: tl.constexpr,  # a power of two >= num_parts
    EPILOGUE: tl.constexpr,
    SUM_SQUARES_OUT: tl.constexpr,  # EPILOGUE == ADD: accumulate the stored values' squares
    W_SCALE: tl.constexpr,  # FP8 weights: each column's sum times its row's scale
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + offs_k[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The first tile is loaded before the wait (weights never depend on the previous kernel).
    w = _weight_tile(w_ptrs, col_mask, 0, offs_k, K, EVEN_N, EVEN_K)
    w_up = w
    if EPILOGUE == 2:
        w_up = _weight_tile(w_ptrs + up_offset, col_mask, 0, offs_k, K, EVEN_N, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    inv_rms = 1.0
    if NORM_GIVEN:
        offs_p = tl.arange(0, PARTS_PAD)
        parts = tl.load(sum_sq_in_ptr + offs_p, mask=offs_p < num_parts, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(parts, axis=0) / K + eps)
    elif NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0).to(tl.float32)
            squares += x * x
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    x = _input_tile(x_ptr, norm_w_ptr, 0, offs_k, K, inv_rms, NORM, EVEN_K)[None, :]
    acc = w.to(tl.float32) * x
    acc_up = acc
    if EPILOGUE == 2:
        acc_up = w_up.to(tl.float32) * x
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x = _input_tile(x_ptr, norm_w_ptr, k, offs_k, K, inv_rms, NORM, EVEN_K)[None, :]
        acc += _weight_tile(w_ptrs, col_mask, k, offs_k, K, EVEN_N, EVEN_K).to(tl.float32) * x
        if EPILOGUE == 2:
            w_up = _weight_tile(w_ptrs + up_offset, col_mask, k, offs_k, K, EVEN_N, EVEN_K)
            acc_up += w_up.to(tl.float32) * x
    y = tl.sum(acc, axis=1)
    if W_SCALE:
        y *= tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out_dtype = y_ptr.dtype.element_ty
    if EPILOGUE == 1:
        addend = tl.load(y_ptr + cols, mask=col_mask, other=0.0)
        stored = y.to(out_dtype) + addend
        tl.store(y_ptr + cols, stored, mask=col_mask)
        if SUM_SQUARES_OUT:  # masked columns loaded 0 and added 0: they add nothing
            value = stored.to(tl.float32)
            tl.store(sum_sq_out_ptr + tl.program_id(0), tl.sum(value * value, axis=0))
    elif EPILOGUE == 2:
        gate = y.to(out_dtype).to(tl.float32)
        up_sum = tl.sum(acc_up, axis=1)
        if W_SCALE:  # the up rows' scales, N rows after the gate rows'
            up_sum *= tl.load(w_scale_ptr + N + cols, mask=col_mask, other=0.0)
        up = up_sum.to(out_dtype)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype)
        tl.store(
            y_ptr + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(out_dtype), mask=col_mask
        )
    else:
        tl.store(y_ptr + cols, y.to(out_dtype), mask=col_mask)


def gemv(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # (N, K), contiguous; (2I, K) for Epilogue.SWIGLU
    bias: torch.Tensor | None = None,  # (N,)
    *,
    out: torch.Tensor | None = None,  # (1, N) ((1, I) for SWIGLU); the addend for ADD
    config: GemvConfig | None = None,
    norm: RowNorm | None = None,
    epilogue: Epilogue = Epilogue.STORE,
    sum_squares_out: torch.Tensor | None = None,  # (programs(N, config),) fp32, with ADD
    pdl: bool = False,
    weight_scale: torch.Tensor | None = None,  # (rows,) fp32, with an e4m3 weight
) -> torch.Tensor:
    """x W^T (+ bias) for one row of x (normed first with `norm`), through `epilogue`, into
    `out` (allocated when not given, except for ADD, which needs its addend); with
    `sum_squares_out`, the ADD epilogue also writes the partial sums of the squares of the new
    `out` there, one per program. With `weight_scale` the weight is e4m3 and W is
    weight * weight_scale[:, None]."""
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be (1, K), got shape {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be (N, K), got shape {tuple(weight.shape)}"
    rows, k = weight.shape
    assert x.shape[1] == k, f"x has K={x.shape[1]}, weight is {tuple(weight.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    if weight_scale is None:
        assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    else:
        assert weight.dtype == FP8_WEIGHT_DTYPE, (
            f"weight_scale goes with an {FP8_WEIGHT_DTYPE} weight, got {weight.dtype}"
        )
        assert weight_scale.shape == (rows,), (
            f"weight_scale shape {tuple(weight_scale.shape)} != ({rows},)"
        )
        assert weight_scale.dtype == torch.float32, (
            f"weight_scale must be float32, got {weight_scale.dtype}"
        )
        assert weight_scale.is_contiguous(), "weight_scale must be contiguous"
        check_device("weight_scale", weight_scale, x.device)
    assert x.stride(1) == 1, "x must be contiguous in its last dimension"
    assert weight.is_contiguous(), "weight must be contiguous"
    check_device("x", x, x.device)
    check_device("weight", weight, x.device)
    n = rows
    if epilogue == Epilogue.SWIGLU:
        assert rows % 2 == 0, f"a SwiGLU weight has 2I rows, got {rows}"
        assert bias is None, "the SwiGLU epilogue takes no bias"
        n = rows // 2
    if bias is not None:
        assert bias.shape == (n,), f"bias shape {tuple(bias.shape)} != ({n},)"
        assert bias.dtype == x.dtype, f"bias is {bias.dtype}, x is {x.dtype}"
        assert bias.is_contiguous(), "bias must be contiguous"
        check_device("bias", bias, x.device)
    if norm is not None:
        assert norm.weight.shape == (k,), f"norm weight shape {tuple(norm.weight.shape)} != ({k},)"
        assert norm.weight.dtype == x.dtype, f"norm weight is {norm.weight.dtype}, x is {x.dtype}"
        assert norm.weight.is_contiguous(), "norm weight must be contiguous"
        check_device("norm weight", norm.weight, x.device)
        if norm.sum_squares is not None:
            _check_statistic("norm sum_squares", norm.sum_squares, x.device)
    cfg = config or CANDIDATES[0]
    if sum_squares_out is not None:
        assert epilogue == Epilogue.ADD, "sum_squares_out goes with Epilogue.ADD"
        _check_statistic("sum_squares_out", sum_squares_out, x.device)
        assert sum_squares_out.shape[0] == programs(n, cfg), (
            f"sum_squares_out has {sum_squares_out.shape[0]} entries for {programs(n, cfg)} "
            "programs"
        )
    if out is None:
        assert epilogue != Epilogue.ADD, "Epilogue.ADD adds into `out`: give it"
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    assert out.shape == (1, n), f"out shape {tuple(out.shape)} != (1, {n})"
    assert out.dtype == x.dtype, f"out is {out.dtype}, x is {x.dtype}"
    assert out.stride(1) == 1, "out must be contiguous in its last dimension"
    check_device("out", out, x.device)
    # Every program reads all of x while others write out: the two must not overlap.
    x_end, out_end = x.data_ptr() + k * x.element_size(), out.data_ptr() + n * out.element_size()
    assert out_end <= x.data_ptr() or x_end <= out.data_ptr(), "out overlaps x"
    extra = {"launch_pdl": True} if pdl else {}
    num_parts = 0 if norm is None or norm.sum_squares is None else norm.sum_squares.shape[0]
    _gemv_kernel[(programs(n, cfg),)](
        x,
        weight,
        bias if bias is not None else weight,
        norm.weight if norm is not None else weight,
        out,
        norm.sum_squares if norm is not None and norm.sum_squares is not None else out,
        sum_squares_out if sum_squares_out is not None else out,
        weight_scale if weight_scale is not None else out,
        num_parts,
        n,
        k,
        weight.stride(0),
        n * weight.stride(0),
        norm.eps if norm is not None else 0.0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        NORM_GIVEN=num_parts > 0,
        PARTS_PAD=next_power_of_2(max(num_parts, 1)),
        EPILOGUE=int(epilogue),
        SUM_SQUARES_OUT=sum_squares_out is not None,
        W_SCALE=weight_scale is not None,
        USE_PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **extra,
    )
    return out


def programs(n: int, config: GemvConfig) -> int:
    """The programs of a GEMV of `n` output columns: entries of its `sum_squares_out`."""
    return -(-n // config.block_n)


def _check_statistic(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    assert tensor.dim() == 1 and tensor.shape[0] >= 1, (
        f"{name} must be (P,) partial sums, got shape {tuple(tensor.shape)}"
    )
    assert tensor.dtype == torch.float32, f"{name} must be float32, got {tensor.dtype}"
    assert tensor.stride(0) == 1, f"{name} must be contiguous"
    check_device(name, tensor, device)
