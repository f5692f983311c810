# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Whole KV blocks between the device pool's layout and a block-major staging buffer.

The device pool is (num_layers, 2, num_blocks, block_size, kv_heads, head_dim): one block is
num_layers x 2 separate chunks. The host tier keeps a block as one contiguous run, so a copy to
or from it goes through a staging buffer on the device, (num_staged, num_layers * 2, chunk):
`gather_blocks` fills it from the pool's blocks `block_ids` (one launch for every layer and
block), `scatter_blocks` writes it back into them. Both move raw words: the values' type does not
matter (bf16, fp16, fp32 or FP8).

Program (i, c) moves chunk c of block `block_ids[i]` in tiles of `TILE` words; offsets are int64
(a pool of 70 GB has more words than an int32 counts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import check_device, next_power_of_2

MAX_TILE = 2048  # words a program moves per iteration


@triton.jit
def _block_copy_kernel(
    pool_ptr,
    staging_ptr,
    ids_ptr,
    pool_chunk_stride,  # words between one (layer, k/v) chunk row of the pool and the next
    num_chunks,
    CHUNK: tl.constexpr,  # words of one block in one (layer, k/v): block_size x heads x dim
    TILE: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    block = tl.load(ids_ptr + i).to(tl.int64)
    pool_base = c * pool_chunk_stride + block * CHUNK
    staging_base = (i.to(tl.int64) * num_chunks + c) * CHUNK
    for start in range(0, CHUNK, TILE):
        offs = start + tl.arange(0, TILE)
        mask = offs < CHUNK
        if TO_STAGING:
            words = tl.load(pool_ptr + pool_base + offs, mask=mask)
            tl.store(staging_ptr + staging_base + offs, words, mask=mask)
        else:
            words = tl.load(staging_ptr + staging_base + offs, mask=mask)
            tl.store(pool_ptr + pool_base + offs, words, mask=mask)


def as_words(pool: torch.Tensor) -> torch.Tensor:
    """`pool` (num_layers, 2, num_blocks, ...) as (num_layers * 2, num_blocks, chunk) words:
    int32 where a chunk's bytes divide by 4, else bytes."""
    assert pool.dim() >= 3 and pool.is_contiguous(), "the pool must be contiguous, rank >= 3"
    num_blocks = pool.shape[2]
    chunk_bytes = pool[0, 0, 0].numel() * pool.element_size()
    word = torch.int32 if chunk_bytes % 4 == 0 else torch.uint8
    as_bytes = pool.view(torch.uint8).view(pool.shape[0] * pool.shape[1], num_blocks, chunk_bytes)
    return as_bytes.view(word)


def _launch(
    pool_words: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor, to_staging: bool
) -> None:
    num_chunks, _, chunk = pool_words.shape
    num = block_ids.numel()
    check_device("staging", staging, pool_words.device)
    check_device("block_ids", block_ids, pool_words.device)
    assert block_ids.dtype == torch.int64 and block_ids.dim() == 1, "block_ids: int64, 1-D"
    assert staging.dtype == pool_words.dtype, (
        f"staging is {staging.dtype}, the pool's words {pool_words.dtype}"
    )
    assert staging.is_contiguous() and staging.shape[1:] == (num_chunks, chunk), (
        f"staging {tuple(staging.shape)} must be (n, {num_chunks}, {chunk}), contiguous"
    )
    assert num <= staging.shape[0], f"{num} blocks do not fit {staging.shape[0]} staged"
    if num == 0:
        return
    _block_copy_kernel[(num, num_chunks)](
        pool_words,
        staging,
        block_ids,
        pool_words.stride(0),
        num_chunks,
        CHUNK=chunk,
        TILE=min(MAX_TILE, next_power_of_2(chunk)),
        TO_STAGING=to_staging,
    )


def gather_blocks(pool_words: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = block `block_ids[i]` of the pool, every (layer, k/v) chunk in order."""
    _launch(pool_words, out, block_ids, to_staging=True)


def scatter_blocks(src: torch.Tensor, block_ids: torch.Tensor, pool_words: torch.Tensor) -> None:
    """Block `block_ids[i]` of the pool = src[i] (the inverse of `gather_blocks`)."""
    _launch(pool_words, src, block_ids, to_staging=False)
