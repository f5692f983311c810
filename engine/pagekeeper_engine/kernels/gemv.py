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
  residual in place, each program its own columns.
- `Epilogue.SWIGLU`: W is the fused (2I, K) gate/up matrix; a program computes its columns of
  both halves and stores silu(gate) * up (`kernels/swiglu.py`'s arithmetic), so the (1, 2I)
  intermediate is never written.

With `pdl` (programmatic dependent launch, Hopper and later) the kernel lets the next kernel in
the stream start launching as soon as all of its own programs run, and it loads its first weight
tile before waiting for the previous kernel: weights do not depend on it, so the launch and the
first DRAM round trip overlap the previous kernel's tail. Everything that reads another kernel's
output, and every store, comes after the wait.

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

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device


@dataclass(frozen=True)
class GemvConfig:
    """One program's tile: `block_n` output columns, K walked `block_k` at a time."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


# What the start-up choice tries against cuBLAS (`model/gemv_choice.py`): the two best of a
# sweep over block_n 2-16, block_k 256-1024, 4-8 warps and 1-4 stages on the Llama-3.1-8B
# projections on an H200 (docs/benchmarks.md, run 11).
CANDIDATES = (GemvConfig(8, 512), GemvConfig(8, 1024))


class Epilogue(enum.IntEnum):
    """What the GEMV does with y: store it, add it into `out`, or store silu(gate) * up."""

    STORE = 0
    ADD = 1
    SWIGLU = 2


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm the GEMV applies to x first: its (K,) weight and epsilon."""

    weight: torch.Tensor
    eps: float


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
    EPILOGUE: tl.constexpr,
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
    if NORM:
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
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out_dtype = y_ptr.dtype.element_ty
    if EPILOGUE == 1:
        addend = tl.load(y_ptr + cols, mask=col_mask, other=0.0)
        tl.store(y_ptr + cols, y.to(out_dtype) + addend, mask=col_mask)
    elif EPILOGUE == 2:
        gate = y.to(out_dtype).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(out_dtype)
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
    pdl: bool = False,
) -> torch.Tensor:
    """x W^T (+ bias) for one row of x (normed first with `norm`), through `epilogue`, into
    `out` (allocated when not given, except for ADD, which needs its addend)."""
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be (1, K), got shape {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be (N, K), got shape {tuple(weight.shape)}"
    rows, k = weight.shape
    assert x.shape[1] == k, f"x has K={x.shape[1]}, weight is {tuple(weight.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
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
    cfg = config or CANDIDATES[0]
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        norm.weight if norm is not None else weight,
        out,
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
        EPILOGUE=int(epilogue),
        USE_PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **extra,
    )
    return out
