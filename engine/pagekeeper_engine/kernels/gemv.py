# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""y = x W^T (+ b) for one row of x: the projections of a batch-1 decode step.

At batch 1 a projection is a matrix-vector product that reads the whole weight once, so its
time is the weight's bytes over memory bandwidth plus the ramp at either end. Each program owns
`block_n` output columns and walks the full K dimension in `block_k`-wide tiles, accumulating
the products elementwise in fp32 registers and reducing across K once, after the loop: no
cross-thread reduction inside the loop and no split-K partials to combine, so the loop body is
loads and fused multiply-adds only and the software pipeline keeps `num_stages` tiles in flight.

Arithmetic: products and sums in fp32, the result (plus bias) rounded once to the output dtype,
as cuBLAS does for a bf16/fp16 GEMM; the summation order differs, so results agree with
`torch.nn.functional.linear` to rounding, not bit for bit.
"""

from __future__ import annotations

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


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    w_row_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        # The weight is read once: evict it first, so it does not push x out of the cache.
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(
                    w_ptrs, mask=col_mask[:, None], other=0.0, eviction_policy="evict_first"
                )
            x = tl.load(x_ptr + k + offs_k)
        else:
            k_mask = (k + offs_k) < K
            w_mask = col_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)


def gemv(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # (N, K), contiguous
    bias: torch.Tensor | None = None,  # (N,)
    *,
    out: torch.Tensor | None = None,  # (1, N)
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for one row of x, into `out` (allocated when not given)."""
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be (1, K), got shape {tuple(x.shape)}"
    assert weight.dim() == 2, f"weight must be (N, K), got shape {tuple(weight.shape)}"
    n, k = weight.shape
    assert x.shape[1] == k, f"x has K={x.shape[1]}, weight is {tuple(weight.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert x.stride(1) == 1, "x must be contiguous in its last dimension"
    assert weight.is_contiguous(), "weight must be contiguous"
    check_device("x", x, x.device)
    check_device("weight", weight, x.device)
    if bias is not None:
        assert bias.shape == (n,), f"bias shape {tuple(bias.shape)} != ({n},)"
        assert bias.dtype == x.dtype, f"bias is {bias.dtype}, x is {x.dtype}"
        assert bias.is_contiguous(), "bias must be contiguous"
        check_device("bias", bias, x.device)
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    assert out.shape == (1, n), f"out shape {tuple(out.shape)} != (1, {n})"
    assert out.dtype == x.dtype, f"out is {out.dtype}, x is {x.dtype}"
    assert out.stride(1) == 1, "out must be contiguous in its last dimension"
    check_device("out", out, x.device)
    # Every program reads all of x while others write out: the two must not overlap.
    x_end, out_end = x.data_ptr() + k * x.element_size(), out.data_ptr() + n * out.element_size()
    assert out_end <= x.data_ptr() or x_end <= out.data_ptr(), "out overlaps x"
    cfg = config or CANDIDATES[0]
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
