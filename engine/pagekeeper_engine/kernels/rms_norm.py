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

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    summed_row_stride,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_row_stride + offs, mask=mask, other=0.0)
        tl.store(summed_ptr + row * summed_row_stride + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / DIM + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_row_stride + offs, weight * normed, mask=mask)


def _check_rows(name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    assert tensor.shape == shape, f"{name} shape {tuple(tensor.shape)} != {tuple(shape)}"
    assert tensor.dtype == dtype, f"{name} is {tensor.dtype}, expected {dtype}"
    assert tensor.stride(1) == 1, f"{name} must be contiguous in its last dimension"


def rms_norm(
    x: torch.Tensor,  # (N, dim); rows may be strided
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual: torch.Tensor | None = None,  # (N, dim), added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (norm(x + residual), x + residual), or (norm(x), None) without a residual."""
    assert x.dim() == 2, f"x must be (rows, dim), got shape {tuple(x.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    num_rows, dim = x.shape
    _check_rows("x", x, x.shape, x.dtype)
    assert weight.shape == (dim,), f"weight shape {tuple(weight.shape)} != ({dim},)"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert weight.is_contiguous(), "weight must be contiguous"
    check_device("weight", weight, x.device)
    out = torch.empty((num_rows, dim), dtype=x.dtype, device=x.device)
    summed = None
    if residual is not None:
        _check_rows("residual", residual, x.shape, x.dtype)
        check_device("residual", residual, x.device)
        summed = torch.empty_like(out)
    check_device("x", x, x.device)
    if num_rows == 0:
        return out, summed
    block = next_power_of_2(dim)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        summed if summed is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        summed.stride(0) if summed is not None else 0,
        eps,
        DIM=dim,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, summed
