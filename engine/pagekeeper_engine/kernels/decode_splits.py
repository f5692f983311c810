# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Combining a split decode's partial outputs (`paged_decode`): each split of a sequence's
context wrote its output and log-sum-exp; the combined output weighs each by its softmax mass.
The last split of a (sequence, KV head) to finish calls `combine_splits` inside the decode
launch; without split counters, `reduce_splits` launches one program per (sequence, KV head)
that does the same arithmetic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import next_power_of_2


@triton.jit
def combine_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq,
    heads,  # (GROUP_PAD,) query heads of this KV head
    g_mask,  # (GROUP_PAD,) real heads
    offs_d,  # (HEAD_DIM,)
    out_token_stride,
    out_head_stride,
    num_splits,  # the partials' stride
    num_live,  # how many of them this sequence wrote
    NUM_HEADS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """out[seq, heads] = the splits' partial outputs weighted by their softmax mass."""
    rows = (seq * NUM_HEADS + heads) * num_splits  # (GROUP_PAD,) row of split 0
    # Split 0 is never empty (seq_len >= 1), so each real head's max is finite; padding heads
    # get 0 and weigh nothing (their lse loads as -inf).
    m = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    for s in range(num_live):
        lse = tl.load(
            part_lse_ptr + rows + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg"
        )
        m = tl.maximum(m, lse)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    hd_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    for s in range(num_live):
        lse = tl.load(
            part_lse_ptr + rows + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg"
        )
        weight = tl.exp2(lse - m)  # an empty split weighs exp2(-inf) = 0
        part = tl.load(
            part_out_ptr + (rows + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=hd_mask,
            other=0.0,
            cache_modifier=".cg",
        )
        acc += part * weight[:, None]
        total += weight
    out = acc / tl.where(g_mask, total, 1.0)[:, None]
    out_offs = seq * out_token_stride + heads[:, None] * out_head_stride + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_out_ptr,  # (B, num_heads, num_splits, HEAD_DIM) fp32
    part_lse_ptr,  # (B, num_heads, num_splits) fp32
    out_ptr,
    out_token_stride,
    out_head_stride,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per (sequence, KV head), combining as the fused reduce's last split does.
    seq = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    heads = tl.program_id(1) * GROUP + offs_g
    combine_splits(
        part_out_ptr,
        part_lse_ptr,
        out_ptr,
        seq,
        heads,
        offs_g < GROUP,
        tl.arange(0, HEAD_DIM),
        out_token_stride,
        out_head_stride,
        num_splits,
        num_splits,
        NUM_KV_HEADS * GROUP,
        GROUP_PAD,
        HEAD_DIM,
    )


def reduce_splits(
    part_out: torch.Tensor,  # (B, num_heads, num_splits, head_dim) fp32
    part_lse: torch.Tensor,  # (B, num_heads, num_splits) fp32
    out: torch.Tensor,  # (B, num_heads, head_dim); may be a strided view
    num_kv_heads: int,
) -> None:
    """out = the splits' partial outputs combined, one program per (sequence, KV head)."""
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    assert part_lse.shape == (num_seqs, num_heads, num_splits), (
        f"part_lse shape {tuple(part_lse.shape)} != {(num_seqs, num_heads, num_splits)}"
    )
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    _reduce_splits_kernel[(num_seqs, num_kv_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        num_warps=4,
    )
