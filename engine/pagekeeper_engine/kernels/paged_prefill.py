# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Prefill / extend attention over a paged prefix.

A sequence contributes `q_len` new query rows at absolute positions
`seq_len - q_len .. seq_len - 1`; its keys, the cached prefix and the new ones alike, are already
in the paged cache (the backend writes them first). Row i attends to every key at a position
<= its own. This one path covers a whole prompt (prefix 0), a chunk of a chunked prefill (prefix
= the earlier chunks) and a prompt whose first blocks were a prefix-cache hit.

One program handles BLOCK_M query rows of one head of one sequence. Key tiles that lie wholly
before the tile's first row need no causal mask and run in a first loop; the few tiles along
the diagonal run masked in a second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import (
    FP8_CACHE_DTYPE,
    check_device,
    check_heads,
    check_index_tensor,
    check_paged_cache,
    dot_precision,
)
from pagekeeper_engine.kernels.paged_kv import LOG2_E, gather_kv_offsets

# Arguments whose alignment or value changes from step to step (see kernels/__init__.py).
STEP_VARYING = (
    "block_tables_ptr",
    "seq_lens_ptr",
    "query_start_loc_ptr",
    "block_table_stride",
)


@triton.jit(do_not_specialize=STEP_VARYING)
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    block_table_stride,
    scale_log2,  # softmax scale * log2(e) (* an FP8 cache's key scale): scores go through exp2
    v_scale,  # an FP8 cache's value scale (1.0 otherwise): the output's factor
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # an FP8 cache: the dots run in fp16 (FP8 widens to it natively)
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    tile_start = tile * BLOCK_M
    is_live = tile_start < q_len  # the grid is sized for the longest query of the step

    offs_m = tile_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(  # (BLOCK_M, HEAD_DIM)
        q_ptr + q_rows[:, None] * q_token_stride + head * q_head_stride + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    if KV_FP8:
        q = q.to(tl.float16)
    pos_m = prefix_len + offs_m  # absolute positions of the query rows
    kv_head = head // GROUP
    block_table_ptr = block_tables_ptr + seq * block_table_stride

    # Keys before `full_end` precede every row of this tile; keys up to `causal_end` reach its
    # last row. A dead tile runs neither loop.
    full_end = tl.where(is_live, (prefix_len + tile_start) // BLOCK_N * BLOCK_N, 0)
    causal_end = tl.where(is_live, tl.minimum(seq_len, prefix_len + tile_start + BLOCK_M), 0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n in range(0, full_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < full_end  # always true; keeps the block-table load in bounds
        kv_offs = gather_kv_offsets(
            block_table_ptr, n, n_mask, offs_d, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N
        )
        # (BLOCK_N, HEAD_DIM), in q's dtype (an FP8 cache is widened here, else a no-op)
        k = tl.load(k_cache_ptr + kv_offs).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    for n in range(full_end, causal_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < causal_end
        kv_offs = gather_kv_offsets(
            block_table_ptr, n, n_mask, offs_d, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N
        )
        k = tl.load(k_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        is_visible = (offs_n[None, :] <= pos_m[:, None]) & n_mask[None, :]
        scores = tl.where(is_visible, scores, float("-inf"))  # (BLOCK_M, BLOCK_N)
        # m_i stays finite (-1e30 at worst), so a row with no visible key here gets p == 0.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every live row sees at least the key at its own position; dead rows are not stored.
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * out_token_stride + head * out_head_stride + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def paged_prefill(
    q: torch.Tensor,  # (T, num_heads, head_dim); rows outside query_start_loc's range untouched
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), new keys included
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (S, max_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (S,) int32: tokens after this step, prefix + query
    query_start_loc: torch.Tensor,  # (S + 1,) int32: row ranges of q, absolute indices
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # (T, num_heads, head_dim); may be a strided view
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,  # the cache holds value / scale: keys and values are that times it
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of S sequences' new rows over their paged prefix and themselves."""
    _, block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_heads = check_heads("q", q, num_kv_heads, head_dim, k_cache.dtype)
    check_index_tensor("block_tables", block_tables, 2, torch.int32)
    check_index_tensor("seq_lens", seq_lens, 1, torch.int32)
    check_index_tensor("query_start_loc", query_start_loc, 1, torch.int32)
    num_seqs = int(seq_lens.shape[0])
    assert block_tables.shape[0] == num_seqs, (
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences"
    )
    assert query_start_loc.shape[0] == num_seqs + 1, (
        f"query_start_loc has {query_start_loc.shape[0]} entries, expected {num_seqs + 1}"
    )
    assert max_query_len >= 0, f"max_query_len {max_query_len} is negative"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape, f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}"
    assert out.dtype == q.dtype, f"out is {out.dtype}, q is {q.dtype}"
    assert out.stride(2) == 1, "out must be contiguous in head_dim"
    for name, tensor in (
        ("q", q),
        ("out", out),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        check_device(name, tensor, k_cache.device)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        assert value >= 16 and value & (value - 1) == 0, f"{name} {value} not a power of 2 >= 16"
    if num_seqs == 0 or max_query_len == 0:
        return out

    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        scale * LOG2_E * k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FP8=k_cache.dtype == FP8_CACHE_DTYPE,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
