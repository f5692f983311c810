# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""What the paged attention kernels (`paged_decode`, `paged_prefill`) share: where a tile of
one KV head's tokens lies in the paged cache, and the base-2 softmax's constant."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # scores are scaled by it so the softmax can use exp2


@triton.jit
def gather_kv_offsets(
    block_table_ptr,  # this sequence's row of the block table
    tile_start,  # first token position of the tile, a multiple of BLOCK_N
    n_mask,  # (BLOCK_N,) positions inside the sequence
    offs_d,  # (HEAD_DIM,)
    kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Element offsets (BLOCK_N, HEAD_DIM) of one KV head's tokens tile_start..+BLOCK_N.

    Both are powers of two, so a tile holds whole blocks or lies inside one: which block a
    lane reads and where in it are then constants of the lane, and no per-token division is
    left in the loop.
    """
    lane = tl.arange(0, BLOCK_N)
    if BLOCK_N >= BLOCK_SIZE:
        block_ids = tl.load(
            block_table_ptr + tile_start // BLOCK_SIZE + lane // BLOCK_SIZE, mask=n_mask, other=0
        )
        # int64: num_blocks * block_size * num_kv_heads * head_dim can pass 2**31 on large GPUs.
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + lane % BLOCK_SIZE
    else:
        block_id = tl.load(block_table_ptr + tile_start // BLOCK_SIZE)  # tile_start < seq_len
        slots = block_id.to(tl.int64) * BLOCK_SIZE + tile_start % BLOCK_SIZE + lane
    return slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
