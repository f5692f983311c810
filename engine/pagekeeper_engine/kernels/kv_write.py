# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Store a step's new keys and values into the paged KV cache at their slots.

`rotate_and_write_kv` also applies the rotary embedding on the way: it rotates q in place and
stores the rotated k, so a layer's rotary and KV write are one launch instead of two. Its
rotation is `kernels/rotary.py`'s arithmetic (fp32 tables, fp32 math, rounded to the dtype).
Given Qwen3's q/k norm weights it first normalises each head of q and k (`kernels/rms_norm.py`'s
arithmetic), which saves that model two more launches a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import check_device, check_heads, check_paged_cache
from pagekeeper_engine.kernels import next_power_of_2 as _pow2
from pagekeeper_engine.kernels.rms_norm import rms_norm_halves
from pagekeeper_engine.kernels.rotary import check_rotary_inputs, load_heads, store_rotated

# Arguments whose alignment or value changes from step to step (see kernels/__init__.py).
STEP_VARYING = ("slot_mapping_ptr", "positions_ptr")


@triton.jit(do_not_specialize=STEP_VARYING)
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    k_inv_scale,  # 1 / the cache's key scale (1.0 unless an FP8 cache has checkpoint scales)
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    # One program per token: its (num_kv_heads, head_dim) row is contiguous in the cache.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # A negative slot marks a padding row (e.g. of a CUDA-graph batch): nothing to store.
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[
            None, :
        ]  # heads < num_kv_heads
        k_src = k_ptr + token * k_token_stride + offs_h[:, None] * k_head_stride + offs_d[None, :]
        v_src = v_ptr + token * v_token_stride + offs_h[:, None] * v_head_stride + offs_d[None, :]
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        # stores narrow to the cache's dtype (FP8: value / scale, round to nearest, saturating
        # at +-448; a scale of 1 leaves other dtypes exact)
        cache_ty = k_cache_ptr.dtype.element_ty
        k_row = tl.load(k_src, mask=mask).to(tl.float32) * k_inv_scale
        v_row = tl.load(v_src, mask=mask).to(tl.float32) * v_inv_scale
        tl.store(k_cache_ptr + dst, k_row.to(cache_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v_row.to(cache_ty), mask=mask)


@triton.jit(do_not_specialize=STEP_VARYING)
def _rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_weight_ptr,  # (head_dim,); read only when HAS_QK_NORM
    k_norm_weight_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    k_inv_scale,
    v_inv_scale,
    norm_eps,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent: wait before any access
):
    # One program per token: (norm and) rotate its q heads in place, store rotated k and v at
    # its slot. Every head of q is loaded before any is stored.
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * HALF + offs_d)[None, :]  # (1, HALF) fp32
    sin = tl.load(sin_ptr + position * HALF + offs_d)[None, :]
    q_token = q_ptr + token * q_token_stride
    q1, q2 = load_heads(q_token, q_head_stride, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    if HAS_QK_NORM:
        q1, q2 = rms_norm_halves(q1, q2, q_norm_weight_ptr, norm_eps, HALF)
    store_rotated(q1, q2, q_token, q_head_stride, cos, sin, 1.0, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    slot = tl.load(slot_mapping_ptr + token)
    # A negative slot marks a padding row (e.g. of a CUDA-graph batch): nothing to store.
    if slot >= 0:
        # The cache row of a slot is (num_kv_heads, head_dim), contiguous.
        dst = slot * (NUM_KV_HEADS * 2 * HALF)
        k1, k2 = load_heads(
            k_ptr + token * k_token_stride, k_head_stride, NUM_KV_HEADS, HEADS_PAD, HALF
        )
        if HAS_QK_NORM:
            k1, k2 = rms_norm_halves(k1, k2, k_norm_weight_ptr, norm_eps, HALF)
        store_rotated(
            k1, k2, k_cache_ptr + dst, 2 * HALF, cos, sin, k_inv_scale, NUM_KV_HEADS, HEADS_PAD,
            HALF,
        )  # fmt: skip
        offs_h = tl.arange(0, HEADS_PAD)
        offs_full = tl.arange(0, 2 * HALF)
        mask = (offs_h < NUM_KV_HEADS)[:, None]
        v_src = (
            v_ptr + token * v_token_stride + offs_h[:, None] * v_head_stride + offs_full[None, :]
        )
        v_dst = v_cache_ptr + dst + offs_h[:, None] * (2 * HALF) + offs_full[None, :]
        v_row = tl.load(v_src, mask=mask).to(tl.float32) * v_inv_scale
        tl.store(v_dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotate_and_write_kv(
    q: torch.Tensor,  # (T, num_heads, head_dim), rotated in place; may be a strided view
    k: torch.Tensor,  # (T, num_kv_heads, head_dim), read only: its rotation goes to the cache
    v: torch.Tensor,  # (T, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (T,) int64
    cos: torch.Tensor,  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64; -1 skips the row's store (q is still rotated)
    k_scale: float = 1.0,  # the cache holds value / scale (an FP8 cache's checkpoint scales)
    v_scale: float = 1.0,
    q_norm_weight: torch.Tensor | None = None,  # (head_dim,) in q's dtype: Qwen3's q/k norm
    k_norm_weight: torch.Tensor | None = None,  # (head_dim,); given with q_norm_weight or not
    norm_eps: float | None = None,  # given with the weights
    pdl: bool = False,  # launch as a programmatic dependent of the kernel before (Hopper+)
) -> None:
    """Rotate q in place and store rotary(k[t]) / k_scale, v[t] / v_scale at slot
    `slot_mapping[t]`, one launch. With the norm weights, q becomes rotary(norm(q)) and the
    cache gets rotary(norm(k)): RMSNorm over each head, `norm_eps` inside the root."""
    assert k_scale > 0 and v_scale > 0, f"KV scales must be positive: {k_scale}, {v_scale}"
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    check_heads("q", q, int(k_cache.shape[2]), int(k_cache.shape[3]), k_cache.dtype)
    check_rotary_inputs(q, k, positions, cos, sin)
    check_device("q", q, k_cache.device)
    for name, tensor in (("positions", positions), ("cos", cos), ("sin", sin)):
        check_device(name, tensor, k_cache.device)
    has_qk_norm = check_qk_norm(q, q_norm_weight, k_norm_weight, norm_eps)
    num_tokens = int(k.shape[0])
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = int(k_cache.shape[2]), int(k_cache.shape[3])
    _rotary_kv_write_kernel[(num_tokens,)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        positions,
        cos,
        sin,
        q_norm_weight if q_norm_weight is not None else cos,  # unread without the norm
        k_norm_weight if k_norm_weight is not None else cos,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        norm_eps if norm_eps is not None else 0.0,
        NUM_Q_HEADS=q.shape[1],
        Q_HEADS_PAD=_pow2(q.shape[1]),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=_pow2(num_kv_heads),
        HALF=head_dim // 2,
        HAS_QK_NORM=has_qk_norm,
        USE_PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


def check_qk_norm(
    q: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    norm_eps: float | None,
) -> bool:
    """Check the optional q/k norm arguments; returns whether they are given."""
    assert (q_norm_weight is None) == (k_norm_weight is None), (
        "q_norm_weight and k_norm_weight must be given together or not at all"
    )
    if q_norm_weight is None or k_norm_weight is None:
        assert norm_eps is None, "norm_eps is given without q_norm_weight and k_norm_weight"
        return False
    assert norm_eps is not None and norm_eps > 0, f"norm_eps must be positive, got {norm_eps}"
    head_dim = int(q.shape[2])
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        assert weight.shape == (head_dim,), f"{name} shape {tuple(weight.shape)} != ({head_dim},)"
        assert weight.dtype == q.dtype, f"{name} is {weight.dtype}, q is {q.dtype}"
        assert weight.is_contiguous(), f"{name} must be contiguous"
        check_device(name, weight, q.device)
    return True


def check_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_k_heads = check_heads("k", k, num_kv_heads, head_dim, k_cache.dtype)
    assert num_k_heads == num_kv_heads, f"k has {num_k_heads} heads, the cache {num_kv_heads}"
    assert v.shape == k.shape, f"v shape {tuple(v.shape)} differs from k {tuple(k.shape)}"
    check_heads("v", v, num_kv_heads, head_dim, k_cache.dtype)
    assert slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    assert slot_mapping.shape == (k.shape[0],), (
        f"slot_mapping shape {tuple(slot_mapping.shape)} != ({k.shape[0]},)"
    )
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    for name, tensor in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        check_device(name, tensor, k_cache.device)


def write_kv(
    k: torch.Tensor,  # (T, num_kv_heads, head_dim); token and head strides may be any
    v: torch.Tensor,  # (T, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64; -1 skips the row
    k_scale: float = 1.0,  # the cache holds value / scale (an FP8 cache's checkpoint scales)
    v_scale: float = 1.0,
) -> None:
    """Store `k[t] / k_scale`, `v[t] / v_scale` at flat slot `slot_mapping[t]` of the caches,
    in place."""
    assert k_scale > 0 and v_scale > 0, f"KV scales must be positive: {k_scale}, {v_scale}"
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = int(k_cache.shape[2]), int(k_cache.shape[3])
    num_tokens = int(k.shape[0])
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=_pow2(num_kv_heads),
        num_warps=4,
    )
