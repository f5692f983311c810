# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Store a step's new keys and values into the paged KV cache at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import check_device, check_heads, check_paged_cache
from pagekeeper_engine.kernels import next_power_of_2 as _pow2


@triton.jit
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
        tl.store(k_cache_ptr + dst, tl.load(k_src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(v_src, mask=mask), mask=mask)


def write_kv(
    k: torch.Tensor,  # (T, num_kv_heads, head_dim); token and head strides may be any
    v: torch.Tensor,  # (T, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64; -1 skips the row
) -> None:
    """Store `k[t]`, `v[t]` at flat slot `slot_mapping[t]` of the caches, in place."""
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
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=_pow2(num_kv_heads),
        num_warps=4,
    )
