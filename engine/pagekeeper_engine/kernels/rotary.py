# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Neox-style rotary embedding applied to q and k in place: one launch instead of ~24.

Same arithmetic as the model's torch RotaryEmbedding: fp32 cos/sin tables indexed by position,
rotation in fp32, the result rounded to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import SUPPORTED_DTYPES, check_device, next_power_of_2


@triton.jit
def load_heads(
    src_ptr,  # this token's first head
    head_stride,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """A token's heads as their two halves, (HEADS_PAD, HALF) each in the input's dtype; the
    padding heads are zero."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NUM_HEADS)[:, None]
    first = src_ptr + offs_h[:, None] * head_stride + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    return x1, x2


@triton.jit
def store_rotated(
    x1,  # (HEADS_PAD, HALF): the first half of each head, in the input's dtype
    x2,
    dst_ptr,  # where the token's rotated heads go
    dst_head_stride,
    cos,  # (1, HALF) fp32
    sin,
    out_scale,  # fp32 multiplier after rounding to the input's dtype (an FP8 cache's 1 / scale)
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate the two halves of each head in fp32, round to the input's dtype, store."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NUM_HEADS)[:, None]
    out_first = dst_ptr + offs_h[:, None] * dst_head_stride + offs_d[None, :]
    # rounded to the input's dtype, then to the output's (an FP8 cache: one more narrowing)
    out_ty = out_first.dtype.element_ty
    first_half, second_half = rotated_halves(x1, x2, cos, sin)
    tl.store(out_first, (first_half.to(tl.float32) * out_scale).to(out_ty), mask=mask)
    tl.store(out_first + HALF, (second_half.to(tl.float32) * out_scale).to(out_ty), mask=mask)


@triton.jit
def rotated_halves(x1, x2, cos, sin):
    """The two halves of each head rotated in fp32 and rounded to the input's dtype."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def rotate_heads(
    src_ptr,  # this token's first head
    dst_ptr,  # where its rotated heads go (src_ptr itself to rotate in place)
    src_head_stride,
    dst_head_stride,
    cos,  # (1, HALF) fp32
    sin,
    out_scale,  # fp32 multiplier after rounding to the input's dtype (an FP8 cache's 1 / scale)
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate the two halves of each of a token's heads, in fp32, rounded to the dtype."""
    # Every head is loaded before any is stored, so dst may be src.
    x1, x2 = load_heads(src_ptr, src_head_stride, NUM_HEADS, HEADS_PAD, HALF)
    store_rotated(x1, x2, dst_ptr, dst_head_stride, cos, sin, out_scale, NUM_HEADS, HEADS_PAD, HALF)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * HALF + offs_d)[None, :]  # (1, HALF) fp32
    sin = tl.load(sin_ptr + position * HALF + offs_d)[None, :]
    q_token = q_ptr + token * q_token_stride
    k_token = k_ptr + token * k_token_stride
    rotate_heads(
        q_token, q_token, q_head_stride, q_head_stride, cos, sin, 1.0, NUM_Q_HEADS, Q_HEADS_PAD,
        HALF,
    )  # fmt: skip
    rotate_heads(
        k_token, k_token, k_head_stride, k_head_stride, cos, sin, 1.0, NUM_K_HEADS, K_HEADS_PAD,
        HALF,
    )  # fmt: skip


def check_rotary_inputs(
    q: torch.Tensor,  # (T, num_heads, head_dim)
    k: torch.Tensor,  # (T, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (T,) int64
    cos: torch.Tensor,  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor,
) -> None:
    """Shapes, dtypes and layouts the rotary kernels rely on (devices are the caller's)."""
    assert q.dim() == 3 and k.dim() == 3, "q and k must be (tokens, heads, head_dim)"
    assert q.dtype in SUPPORTED_DTYPES and k.dtype == q.dtype, "q and k must share a float dtype"
    num_tokens, _, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}"
    )
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must be contiguous in head_dim"
    half = head_dim // 2
    assert head_dim % 2 == 0 and half == next_power_of_2(half), (
        f"head_dim {head_dim} must be twice a power of 2"
    )
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64, (
        f"positions must be ({num_tokens},) int64, got {tuple(positions.shape)} {positions.dtype}"
    )
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.dtype == torch.float32, f"{name} must be float32, got {table.dtype}"
        assert table.dim() == 2 and table.shape[1] == half, (
            f"{name} must be (max_position, {half}), got {tuple(table.shape)}"
        )
        assert table.is_contiguous(), f"{name} must be contiguous"


def apply_rotary_(
    q: torch.Tensor,  # (T, num_heads, head_dim), rotated in place; may be a strided view
    k: torch.Tensor,  # (T, num_kv_heads, head_dim), rotated in place
    positions: torch.Tensor,  # (T,) int64
    cos: torch.Tensor,  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor,
) -> None:
    """Rotate the halves of every head of q and k by the angle of each token's position."""
    check_rotary_inputs(q, k, positions, cos, sin)
    for name, tensor in (("k", k), ("positions", positions), ("cos", cos), ("sin", sin)):
        check_device(name, tensor, q.device)
    check_device("q", q, q.device)
    num_tokens = int(q.shape[0])
    if num_tokens == 0:
        return
    half = int(q.shape[2]) // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        NUM_Q_HEADS=q.shape[1],
        NUM_K_HEADS=k.shape[1],
        Q_HEADS_PAD=next_power_of_2(q.shape[1]),
        K_HEADS_PAD=next_power_of_2(k.shape[1]),
        HALF=half,
        num_warps=4,
    )
