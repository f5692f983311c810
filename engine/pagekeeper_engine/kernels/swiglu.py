# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""SwiGLU activation, silu(gate) * up, over the fused gate/up projection: one launch instead of 3.

Same arithmetic as `functional.silu(gate) * up` in torch: silu in fp32 rounded to the input
dtype, then the product in fp32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_row_stride,
    out_row_stride,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    src = gate_up_ptr + row * gate_up_row_stride + offs
    gate = tl.load(src, mask=mask, other=0.0)
    up = tl.load(src + INTERMEDIATE, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * out_row_stride + offs, out, mask=mask)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: (N, 2 * I), gate in the first I columns, up in the last -> (N, I), into `out`
    when given (rows may be strided)."""
    assert gate_up.dim() == 2, f"gate_up must be (rows, 2 * I), got {tuple(gate_up.shape)}"
    assert gate_up.dtype in SUPPORTED_DTYPES, f"gate_up dtype {gate_up.dtype} is not supported"
    assert gate_up.shape[1] % 2 == 0, f"gate_up width {gate_up.shape[1]} is odd"
    assert gate_up.stride(1) == 1, "gate_up must be contiguous in its last dimension"
    check_device("gate_up", gate_up, gate_up.device)
    num_rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_rows, intermediate), f"out shape {tuple(out.shape)} is wrong"
    assert out.dtype == gate_up.dtype, f"out is {out.dtype}, gate_up is {gate_up.dtype}"
    assert out.stride(1) == 1, "out must be contiguous in its last dimension"
    check_device("out", out, gate_up.device)
    if num_rows == 0:
        return out
    _swiglu_kernel[(num_rows, triton.cdiv(intermediate, BLOCK))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out
