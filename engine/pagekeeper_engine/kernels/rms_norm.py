# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""RMSNorm, optionally fused with the residual add before it: one launch instead of ~9.

Same arithmetic as the model's torch RMSNorm: the residual sum is rounded to the input dtype,
statistics are fp32, the normalised row is rounded to the input dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, check_like, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_row_stride,
    x_head_stride,
    residual_row_stride,
    out_row_stride,
    out_head_stride,
    summed_row_stride,
    eps,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # One program per (row, head); the whole row is loaded before anything is stored, so out
    # may be x and summed may be residual (in place).
    program = tl.program_id(0).to(tl.int64)
    row = program // HEADS
    head = program % HEADS
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    x = tl.load(x_ptr + row * x_row_stride + head * x_head_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_row_stride + offs, mask=mask, other=0.0)
        tl.store(summed_ptr + row * summed_row_stride + offs, x, mask=mask)
    out = rms_norm_row(x, weight_ptr, offs, mask, eps, DIM)
    tl.store(out_ptr + row * out_row_stride + head * out_head_stride + offs, out, mask=mask)


@triton.jit
def rms_norm_row(x, weight_ptr, offs, mask, eps, DIM: tl.constexpr):
    """One row's norm in x's dtype (masked lanes zero): the fp32 statistic, the normalised row
    rounded to x's dtype, then the weight multiply. Shared by the kernels that norm a row."""
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / DIM + eps)
    # The product of two half-precision values is exact in fp32, so rounding it once is the
    # half-precision multiply (which the interpreter cannot run).
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed).to(x.dtype)


@triton.jit
def rms_norm_halves(
    x1,  # (HEADS, HALF): the first half of each head's vector, in the input's dtype
    x2,  # (HEADS, HALF): the second half
    weight_ptr,  # (2 * HALF,) in the input's dtype
    eps,
    HALF: tl.constexpr,
):
    """Each head's norm, in halves as the rotary kernels hold a head; `_rms_norm_kernel`'s
    arithmetic. Returns (first, second) in the input's dtype."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    sum_sq = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)  # (HEADS,)
    inv_rms = tl.rsqrt(sum_sq / (2 * HALF) + eps)[:, None]
    offs_d = tl.arange(0, HALF)
    weight1 = tl.load(weight_ptr + offs_d)[None, :].to(tl.float32)
    weight2 = tl.load(weight_ptr + HALF + offs_d)[None, :].to(tl.float32)
    # The product of two half-precision values is exact in fp32, so rounding it once is the
    # half-precision multiply (and the interpreter, unlike the GPU, cannot multiply bf16).
    normed1 = (x1f * inv_rms).to(x1.dtype).to(tl.float32)
    normed2 = (x2f * inv_rms).to(x2.dtype).to(tl.float32)
    return (weight1 * normed1).to(x1.dtype), (weight2 * normed2).to(x2.dtype)


def rms_norm(
    x: torch.Tensor,  # (N, dim) or (N, heads, dim); rows and heads may be strided
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual: torch.Tensor | None = None,  # (N, dim), added to x first (2-D x only)
    *,
    out: torch.Tensor | None = None,  # like x; may be x itself
    summed: torch.Tensor | None = None,  # like residual; may be residual itself
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (norm(x + residual), x + residual), or (norm(x), None) without a residual.

    A 3-D x normalises each head's vector (the q/k norm), e.g. in place over a view of the
    fused qkv projection. `out` and `summed` name where the results go; without them, new
    tensors are allocated.
    """
    assert x.dim() in (2, 3), f"x must be (rows, dim) or (rows, heads, dim), got {tuple(x.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    assert x.stride(-1) == 1, "x must be contiguous in its last dimension"
    check_device("x", x, x.device)
    num_rows, dim = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    assert weight.shape == (dim,), f"weight shape {tuple(weight.shape)} != ({dim},)"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert weight.is_contiguous(), "weight must be contiguous"
    check_device("weight", weight, x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check_like("out", out, x)
    if residual is not None:
        assert x.dim() == 2, "a residual is added to 2-D rows only"
        check_like("residual", residual, x)
        if summed is None:
            summed = torch.empty_like(out)
        check_like("summed", summed, x)
    else:
        summed = None
    if num_rows == 0:
        return out, summed
    block = next_power_of_2(dim)
    _rms_norm_kernel[(num_rows * heads,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        summed if summed is not None else out,
        x.stride(0),
        x.stride(1) if heads > 1 else 0,
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        out.stride(1) if heads > 1 else 0,
        summed.stride(0) if summed is not None else 0,
        eps,
        HEADS=heads,
        DIM=dim,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, summed
