# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""One split-decode program's work, shared by the two decode kernels (`paged_decode`, and
`rotary_decode`, which norms and rotates q and writes the new key and value first): the range of
the context its split covers, the online softmax over that range's tiles (`attend_tiles`; or
`softmax_tile` on a first tile loaded early, then `attend_more_tiles`), and what it does with
the result (store the output, or a partial and its log-sum-exp, combined in the launch by the
split that finishes last).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagekeeper_engine.kernels.decode_splits import combine_splits
from pagekeeper_engine.kernels.paged_kv import gather_kv_offsets


@triton.jit
def decode_program(
    seq_lens_ptr,
    num_splits,
    short_split_tokens,
    long_split_tokens,
    BLOCK_N: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,
):
    """This program of a decode grid (KV heads, sequences, splits): (seq, kv_head, split,
    seq_len, live, start, end), where live is how many splits the sequence uses and
    start..end this split's tokens.

    The KV heads vary fastest, so a sequence's programs start together and a step whose decodes lead
    longest first (`runner/step_inputs.py`) hands out its longest programs first: the last wave then
    holds short ones, not a long one that runs on alone (docs/benchmarks-archive.md, "a decode
    launch's last wave").

    Each split covers a whole number of BLOCK_N tiles, an even share of the context over the
    launch's splits. With the reduce fused, a sequence shorter than the splits were chosen for
    (a CUDA graph fixes them for its longest context) gives each split at least
    `short_split_tokens` while it fits in SHORT_SPLITS of them, else at least
    `long_split_tokens` (`paged_decode.SplitRule`), and uses only the splits its tokens reach,
    at least one; the others get an empty range."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    live = num_splits
    if FUSED_REDUCE:
        short = tl.cdiv(short_split_tokens, BLOCK_N) * BLOCK_N
        long = tl.cdiv(long_split_tokens, BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, tl.where(seq_len <= SHORT_SPLITS * short, short, long))
        live = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return seq, kv_head, split, seq_len, live, start, end


@triton.jit
def load_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # this sequence's row
    kv_head,
    n,  # the tile's first position, a multiple of BLOCK_N below `end` (or 0 with no tokens)
    end,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One KV head's keys and values at positions n..n+BLOCK_N below `end`, (BLOCK_N,
    HEAD_DIM) each in the cache's dtype; positions from `end` on read as zero."""
    offs_d = tl.arange(0, HEAD_DIM)
    n_mask = (n + tl.arange(0, BLOCK_N)) < end
    kv_offs = gather_kv_offsets(
        block_table_ptr, n, n_mask, offs_d, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N
    )
    k = tl.load(k_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0)
    return k, v


@triton.jit
def softmax_tile(
    q, k, v, n, end, scale_log2, m_i, l_i, acc, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """The online softmax's step over one tile (`load_tile`'s k and v at positions n..): the
    new (acc, m, l). The tile is widened to q's dtype here (an FP8 cache; else a no-op)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    n_mask = (n + tl.arange(0, BLOCK_N)) < end
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(n_mask[None, :], scores, float("-inf"))  # (GROUP_PAD, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_tiles(
    q,  # (GROUP_PAD, HEAD_DIM) in the dots' dtype; padding rows zero
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # this sequence's row
    kv_head,
    start,
    end,
    scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online softmax of q against tokens start..end of one KV head: (acc, m, l), the
    unnormalised output (GROUP_PAD, HEAD_DIM) fp32, the running maximum and the mass (base 2).
    Each key tile is read once for the whole group of query heads."""
    acc, m_i, l_i = softmax_start(GROUP_PAD, HEAD_DIM)
    return attend_more_tiles(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, end,
        scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def softmax_start(GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax's state before any tile: (acc, m, l) = (0, -1e30, 0)."""
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    return acc, m_i, l_i


@triton.jit
def attend_more_tiles(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    start,  # a tile's first position (BLOCK_N apart from the split's start)
    end,
    scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online softmax's state (acc, m, l) carried on over the tiles from start to end."""
    for n in range(start, end, BLOCK_N):
        k, v = load_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, n, end, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = softmax_tile(
            q, k, v, n, end, scale_log2, m_i, l_i, acc, BLOCK_N, DOT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def finish_split(
    acc,
    m_i,
    l_i,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    seq,
    kv_head,
    split,
    live,
    num_splits,
    out_token_stride,
    out_head_stride,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
):
    """Store the split's result: the output itself when it is the sequence's only split, else
    its partial output and log-sum-exp; with the reduce fused, the split of a (sequence, KV
    head) that finishes last combines the partials into the output."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    hd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_offs = seq * out_token_stride + heads[:, None] * out_head_stride + offs_d[None, :]
    if not IS_SPLIT:
        # seq_len >= 1, so every real row saw at least one key and l_i > 0.
        out = acc * (v_scale / l_i)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    elif live == 1:
        if split == 0:  # the whole sequence: l_i > 0 as above
            out = acc * (v_scale / l_i)[:, None]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    elif split < live:
        is_empty = l_i == 0.0
        safe_l = tl.where(is_empty, 1.0, l_i)
        out = acc * (v_scale / safe_l)[:, None]
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(safe_l))
        row = (seq * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hd_mask)
        tl.store(part_lse_ptr + row, lse, mask=offs_g < GROUP)
        if FUSED_REDUCE:
            # Every thread's partial stores precede the counter's release (barrier, then an
            # acq_rel atomic at GPU scope); the split that counts last acquires all of them.
            tl.debug_barrier()
            counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
            num_done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if num_done == live - 1:
                combine_splits(
                    part_out_ptr,
                    part_lse_ptr,
                    out_ptr,
                    seq,
                    heads,
                    offs_g < GROUP,
                    offs_d,
                    out_token_stride,
                    out_head_stride,
                    num_splits,
                    live,
                    NUM_KV_HEADS * GROUP,
                    GROUP_PAD,
                    HEAD_DIM,
                )
                tl.store(counter, 0)  # zero again for the next launch (stream-ordered)
