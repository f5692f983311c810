# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Decode attention with the layer's rotary embedding and KV write in the same launch.

At a decode step `rotate_and_write_kv` (kv_write.py) is a launch of its own before the attention,
and at small batches a launch costs more than its work: ~3 us of a batch-1 layer's ~28 us on
Qwen3-0.6B (docs/benchmarks-archive.md, "rotary, KV write and attention in one launch"). Here each
decode program norms (Qwen3) and rotates its own group of query heads in registers, and the one
split of a (sequence, KV head) that reads the newest position first stores that token's rotated key
and value in the cache, waits for its own threads (a barrier), and then reads its tiles as
`paged_decode` does (`decode_core.py`). The arithmetic is the two launches': q and k are rounded to
the model's dtype after the rotation, as the in-place rotation stores them, so the output and the
cache's bytes are theirs.

Launched as a programmatic dependent of the qkv projection (the batch-1 layer), a program
starts its chain of dependent loads (length, block table, first KV tile) before it waits for
the projection: the earlier steps' keys and values and this step's inputs are final by then.
The first tile of the split that holds the newest position read that slot before it was
written, so that split reads the tile again after its store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import check_device
from pagekeeper_engine.kernels.decode_core import (
    attend_more_tiles,
    decode_program,
    finish_split,
    load_tile,
    softmax_start,
    softmax_tile,
)
from pagekeeper_engine.kernels.decode_splits import reduce_splits
from pagekeeper_engine.kernels.kv_write import check_kv_write, check_qk_norm
from pagekeeper_engine.kernels.paged_decode import SPLIT_RULE, SplitRule, prepare_decode
from pagekeeper_engine.kernels.paged_decode import STEP_VARYING as DECODE_STEP_VARYING
from pagekeeper_engine.kernels.paged_kv import LOG2_E
from pagekeeper_engine.kernels.rms_norm import rms_norm_halves
from pagekeeper_engine.kernels.rotary import (
    check_rotary_inputs,
    load_heads,
    rotated_halves,
    store_rotated,
)

# Arguments whose alignment or value changes from step to step (see kernels/__init__.py): the
# decode kernel's, and this step's positions and slots.
STEP_VARYING = (*DECODE_STEP_VARYING, "positions_ptr", "slot_mapping_ptr")


@triton.jit(do_not_specialize=STEP_VARYING)
def _rotary_decode_kernel(
    q_ptr,  # (B, num_heads, HEAD_DIM) as projected: neither normed nor rotated
    k_ptr,  # (B, NUM_KV_HEADS, HEAD_DIM) the new keys, as projected
    v_ptr,
    positions_ptr,  # (B,) int64
    slot_mapping_ptr,  # (B,) int64; negative: a padding row, nothing stored
    cos_ptr,  # (max_position, HEAD_DIM // 2) fp32
    sin_ptr,
    q_norm_weight_ptr,  # (HEAD_DIM,); read only when HAS_QK_NORM
    k_norm_weight_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    out_token_stride,
    out_head_stride,
    block_table_stride,
    scale_log2,
    k_inv_scale,  # 1 / the cache's key scale, applied on the way in
    v_inv_scale,
    v_scale,  # the output's factor (the cache's value scale)
    norm_eps,
    num_splits,
    short_split_tokens,
    long_split_tokens,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Before the wait: what no kernel of this step writes. The step's inputs (lengths, block
    # tables, positions) and the keys and values of earlier steps, so the split's first tile
    # and its chain of dependent loads overlap the projection before it.
    seq, kv_head, split, seq_len, live, start, end = decode_program(
        seq_lens_ptr, num_splits, short_split_tokens, long_split_tokens, BLOCK_N, FUSED_REDUCE,
        SHORT_SPLITS,
    )  # fmt: skip
    block_table_ptr = block_tables_ptr + seq * block_table_stride
    has_tokens = start < end  # an empty split's tile is at 0, all masked
    first_k, first_v = load_tile(
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, tl.where(has_tokens, start, 0),
        tl.where(has_tokens, end, 0), NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    position = tl.load(positions_ptr + seq)
    offs_half = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * HALF + offs_half)[None, :]  # (1, HALF) fp32
    sin = tl.load(sin_ptr + position * HALF + offs_half)[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # This KV head's query heads, (normed and) rotated in registers; padding rows are zero.
    q_first = q_ptr + seq * q_token_stride + kv_head * GROUP * q_head_stride
    q1, q2 = load_heads(q_first, q_head_stride, GROUP, GROUP_PAD, HALF)
    if HAS_QK_NORM:
        q1, q2 = rms_norm_halves(q1, q2, q_norm_weight_ptr, norm_eps, HALF)
    q1, q2 = rotated_halves(q1, q2, cos, sin)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))
    if KV_FP8:
        q = q.to(tl.float16)
    # The newest position (seq_len - 1) is in the last non-empty split: it stores the new key
    # and value before reading, and the barrier makes its threads' stores visible to its loads.
    if (start < end) & (end == seq_len):
        slot = tl.load(slot_mapping_ptr + seq)
        if slot >= 0:
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            k1, k2 = load_heads(
                k_ptr + seq * k_token_stride + kv_head * k_head_stride, 0, 1, 2, HALF
            )
            if HAS_QK_NORM:
                k1, k2 = rms_norm_halves(k1, k2, k_norm_weight_ptr, norm_eps, HALF)
            store_rotated(k1, k2, k_cache_ptr + dst, 0, cos, sin, k_inv_scale, 1, 2, HALF)
            offs_d = tl.arange(0, HEAD_DIM)
            v_row = tl.load(v_ptr + seq * v_token_stride + kv_head * v_head_stride + offs_d)
            v_row = v_row.to(tl.float32) * v_inv_scale
            tl.store(v_cache_ptr + dst + offs_d, v_row.to(v_cache_ptr.dtype.element_ty))
        tl.debug_barrier()
        if seq_len - 1 < start + BLOCK_N:  # the first tile, read before, holds the new token
            first_k, first_v = load_tile(
                k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, end, NUM_KV_HEADS,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            )  # fmt: skip
    # The first tile, then the rest: an empty split's masked tile leaves the start state.
    acc, m_i, l_i = softmax_start(GROUP_PAD, HEAD_DIM)
    acc, m_i, l_i = softmax_tile(
        q, first_k, first_v, start, end, scale_log2, m_i, l_i, acc, BLOCK_N, DOT_PRECISION
    )
    acc, m_i, l_i = attend_more_tiles(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start + BLOCK_N,
        end, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    finish_split(
        acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, seq, kv_head, split,
        live, num_splits, out_token_stride, out_head_stride, v_scale, NUM_KV_HEADS, GROUP,
        GROUP_PAD, HEAD_DIM, IS_SPLIT, FUSED_REDUCE,
    )  # fmt: skip


def rotary_decode(
    q: torch.Tensor,  # (B, num_heads, head_dim) as projected: read only
    k: torch.Tensor,  # (B, num_kv_heads, head_dim) as projected: its rotation goes to the cache
    v: torch.Tensor,  # (B, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (B,) int64: each sequence's newest position, seq_lens - 1
    cos: torch.Tensor,  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (B,) int64; -1 stores nothing (a graph's padding row)
    block_tables: torch.Tensor,  # (B, max_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (B,) int32, each >= 1, the new token included
    scale: float,
    *,
    out: torch.Tensor | None = None,  # (B, num_heads, head_dim); may be a strided view
    num_splits: int = 1,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    split_counters: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm_weight: torch.Tensor | None = None,  # Qwen3's q/k norm, as `rotate_and_write_kv`
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    split_rule: SplitRule = SPLIT_RULE,
    pdl: bool = False,
) -> torch.Tensor:
    """`rotate_and_write_kv` of one decode token per sequence, then `paged_decode` of the
    rotated q, in one launch (two where the splits are reduced by a second kernel). q itself
    is left as it was; the arguments mean what they mean there."""
    assert k_scale > 0 and v_scale > 0, f"KV scales must be positive: {k_scale}, {v_scale}"
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    check_rotary_inputs(q, k, positions, cos, sin)
    for name, tensor in (("positions", positions), ("cos", cos), ("sin", sin)):
        check_device(name, tensor, k_cache.device)
    has_qk_norm = check_qk_norm(q, q_norm_weight, k_norm_weight, norm_eps)
    launch = prepare_decode(
        q, k_cache, v_cache, block_tables, seq_lens, out, num_splits, block_n, split_counters,
    )  # fmt: skip
    if launch.num_seqs == 0:
        return launch.out
    _rotary_decode_kernel[launch.grid](
        q, k, v, positions, slot_mapping, cos, sin,
        q_norm_weight if q_norm_weight is not None else cos,  # unread without the norm
        k_norm_weight if k_norm_weight is not None else cos,
        k_cache, v_cache, block_tables, seq_lens,
        launch.out, launch.part_out, launch.part_lse, launch.counters,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        launch.out.stride(0), launch.out.stride(1), block_tables.stride(0),
        scale * LOG2_E * k_scale, 1.0 / k_scale, 1.0 / v_scale, v_scale,
        norm_eps if norm_eps is not None else 0.0,
        num_splits, split_rule.short_tokens, split_rule.long_tokens,
        HAS_QK_NORM=has_qk_norm,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch.constants,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    if num_splits > 1 and not launch.fused_reduce:
        reduce_splits(launch.part_out, launch.part_lse, launch.out, launch.num_kv_heads)
    return launch.out
