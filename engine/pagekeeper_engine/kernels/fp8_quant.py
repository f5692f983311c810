# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Per-token FP8 quantization of a GEMM's activations: x (M, K) -> e4m3 (M, K) and (M, 1) fp32
scales, t[m] = max_k |x[m, k]| / 448 (at least `MIN_SCALE`), q = round_e4m3(x / t[m]).

One program a row, in two passes over it: the row's largest magnitude, then each value divided
by the scale and narrowed. Done in torch, the same takes an fp32 copy of x and its quotient
(8 bytes per element where the result is 1): at an 8,192-token step into the down projection
of an 8B model that is about 1 GiB of activations, and four launches instead of one.
Arithmetic: `model.fp8.quantize_tokens` exactly (fp32 division, round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
MAX_BLOCK_K = 1024


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    x_row_stride,
    q_row_stride,
    BLOCK_K: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_row + k + offs, mask=(k + offs) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_LIMIT, SCALE_FLOOR)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK_K):
        mask = (k + offs) < K
        x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_row + k + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (M, K) -> ((M, K) e4m3, (M, 1) fp32 scales), one scale per row."""
    assert x.dim() == 2, f"x must be (M, K), got shape {tuple(x.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not supported"
    assert x.stride(1) == 1, "x must be contiguous in its last dimension"
    check_device("x", x, x.device)
    num_rows, k = x.shape
    quantized = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return quantized, scales
    _quantize_rows_kernel[(num_rows,)](
        x,
        quantized,
        scales,
        k,
        x.stride(0),
        quantized.stride(0),
        BLOCK_K=min(next_power_of_2(k), MAX_BLOCK_K),
        FP8_LIMIT=FP8_MAX,
        SCALE_FLOOR=MIN_SCALE,
        num_warps=4,
    )
    return quantized, scales
