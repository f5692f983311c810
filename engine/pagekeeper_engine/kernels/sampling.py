"""The sampler's last step, fused: each row's token and its log-probability, in one launch on
one rank and in two around the ranks' exchange under tensor parallelism (the kernels are in
`pick_kernels.py`).

    token   = argmax_v (scores[v] * scale - log(max(noise[v], NOISE_FLOOR)))   (ties: lowest)
    logprob = raw[token] - logsumexp(raw)

all in fp32, whatever the dtypes the operands are stored in: the logits may be read in the
model's dtype (bf16 / fp16), widened in registers, so that no step copies them to fp32 first.

Given the schemas' token bitmask, the one-rank pick reads each score whose token's bit is clear as
-inf: the mask is applied where the scores are read, instead of by a pass over them first.

Without noise it is the greedy argmax. With scale = 1 / T and noise E ~ Exp(1) it is the exponential
race (the Gumbel-max trick: -log E is Gumbel-distributed), which samples exactly from
softmax(scores / T). Given `sample_key` instead of draws, the one-rank pick samples the same
distribution by inverting each row's CDF at one uniform draw (`pick_kernels._sample_row`, Philox
keyed by `sample_key` and the row): one draw a row instead of one a row and column. At 256 rows of a
151,936-entry vocabulary the race's draws are 156 MB, written by one kernel and read by the pick,
and the race cost an H100 2.6x a greedy pick (200 against 77 us); W-nano on an H200 ran 1.2-1.3%
faster greedy than at temperature 0.6 (docs/benchmarks-archive.md, "a pick that draws one number a
row").

Why: on an H200, at batch 1, torch's sampler cost ~120 us of a ~4.6 ms decode step of an 8B
model. Its softmax over a 128,256-entry vocabulary runs one thread block per row (33 us at one
row), argmax 28 us, logsumexp ~28 us, plus ~10 small elementwise kernels: a row is processed by
one SM. Here each row's vocabulary is split into BLOCK_V chunks, one program each (63 per row at
128,256), which write their running max and sum of exp for the logsumexp and their best score
and its index; the row's chunks are then merged into the token ids and the (2, N) float64 [ids;
log-probabilities] the runner copies to the host. On one rank that is one launch (`pick_tokens`):
each chunk's program counts itself in on its row's counter after its stores, and the program
that counts last merges the row and zeroes the counter again. A Triton launch costs the host
more than the merge costs the device (~45 us of a batch-1 step's ~0.6 ms of host work on an
H200's host; docs/benchmarks-archive.md, "the batch-1 host step, as long as the device's").

Under tensor parallelism each rank holds a shard of the vocabulary's logits: the first kernel
runs over the shard alone (its chunks' indices offset to the whole vocabulary's), the ranks
exchange the partials (a few kB a row instead of the logits) and every rank's second kernel
merges all of them into the same tokens. A chunk's partials carry the raw logit at its best
index, so the merge needs no logit from another rank.
"""

from __future__ import annotations

import math

import torch
import triton

from pagekeeper_engine.kernels import NOISE_FLOOR, check_device, check_like, next_power_of_2
from pagekeeper_engine.kernels.pick_kernels import (
    ARGMAX,
    INVERSE_CDF,
    RACE,
    chunk_partials_kernel,
    combine_chunks_kernel,
    pick_kernel,
)
from pagekeeper_engine.kernels.pick_scratch import BLOCK_V, PLANES, PickScratch

__all__ = ["BLOCK_V", "PLANES", "PickScratch", "chunk_partials", "combine_partials", "pick_tokens"]

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def chunk_partials(
    scores: torch.Tensor,  # (N, W) fp32 or raw's dtype: the logits after masks and cuts, or raw
    raw: torch.Tensor,  # (N, W) fp32, bf16 or fp16: the model's unmodified logits
    *,
    scale: float = 1.0,  # 1 / temperature
    noise: torch.Tensor | None = None,  # (N, W) fp32 Exp(1) draws, each >= 0
    scratch: PickScratch,
    valid: int | None = None,  # the columns read (default: all W); the rest are padding
    index_offset: int = 0,  # column 0's index in the whole vocabulary
    vocab_size: int | None = None,  # the whole vocabulary's (default: W)
) -> torch.Tensor:
    """The first launch: every chunk's partials of these columns, (PLANES, N, C) fp32 in
    `scratch` (the gather's send buffer under tensor parallelism)."""
    _check_pick_operands(scores, raw, scale, noise)
    num_rows, width = raw.shape
    valid = width if valid is None else valid
    vocab_size = width if vocab_size is None else vocab_size
    assert 0 <= valid <= width, f"valid {valid} outside the {width} columns"
    assert index_offset >= 0 and index_offset + valid <= vocab_size, (
        f"columns [{index_offset}, {index_offset + valid}) outside a vocabulary of {vocab_size}"
    )
    assert vocab_size >= 1, "raw has an empty vocabulary"
    _check_scratch(scratch, raw)
    block_v, num_chunks = scratch.block_v, scratch.num_chunks
    _, _, parts = scratch.views(num_rows)
    if num_rows == 0:
        return parts
    noise_or_scores = scores if noise is None else noise  # never read without noise
    chunk_partials_kernel[(num_rows, num_chunks)](
        scores,
        raw,
        noise_or_scores,
        parts,
        parts.view(torch.int32),
        scores.stride(0),
        raw.stride(0),
        noise_or_scores.stride(0),
        num_rows * num_chunks,
        scale,
        VOCAB=valid,
        INDEX_OFFSET=index_offset,
        NO_INDEX=vocab_size,
        NUM_CHUNKS=num_chunks,
        BLOCK_V=block_v,
        RULE=ARGMAX if noise is None else RACE,
        NOISE_FLOOR=NOISE_FLOOR,
        num_warps=8,
    )
    return parts


def combine_partials(
    parts: torch.Tensor,  # (R, PLANES, N, C) fp32: every rank's partials, in rank order
    scratch: PickScratch,
    vocab_size: int,  # the whole vocabulary's
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second launch: token ids (N,) int64 and packed (2, N) float64 [ids;
    log-probabilities] in `scratch`, merged from every rank's chunks."""
    assert parts.dim() == 4 and parts.shape[1] == PLANES, (
        f"parts must be (ranks, {PLANES}, rows, chunks), got {tuple(parts.shape)}"
    )
    ranks, _, num_rows, num_chunks = parts.shape
    assert parts.dtype == torch.float32 and parts.is_contiguous(), "parts: contiguous fp32"
    assert num_chunks == scratch.num_chunks, (
        f"parts have {num_chunks} chunks a rank, the scratch {scratch.num_chunks}"
    )
    assert vocab_size >= 1, "an empty vocabulary"
    check_device("parts", parts, scratch.token_ids.device)
    token_ids, packed, _ = scratch.views(num_rows)
    if num_rows == 0:
        return token_ids, packed
    combine_chunks_kernel[(num_rows,)](
        parts,
        parts.view(torch.int32),
        token_ids,
        packed,
        num_rows * num_chunks,
        PLANES * num_rows * num_chunks,
        packed.stride(0),
        VOCAB=vocab_size,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=next_power_of_2(num_chunks),
        RANKS=ranks,
        RANKS_PAD=next_power_of_2(ranks),
        num_warps=1,
    )
    return token_ids, packed


def pick_tokens(
    scores: torch.Tensor,  # (N, V) fp32 or raw's dtype: the logits after masks and cuts, or raw
    raw: torch.Tensor,  # (N, V) fp32, bf16 or fp16: the model's unmodified logits
    *,
    scale: float = 1.0,  # 1 / temperature
    noise: torch.Tensor | None = None,  # (N, V) fp32 Exp(1) draws, each >= 0
    sample_key: int | None = None,  # instead of `noise`: invert the CDF at draws of this key
    scratch: PickScratch | None = None,  # where the results go; default: new tensors
    block_v: int | None = None,  # vocabulary entries a program reads; default: the scratch's
    bitmask: torch.Tensor | None = None,  # (N, ceil(V / 32)) int32: the allowed tokens' bits
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the token ids (N,) int64 and the packed (2, N) float64: the same ids, then their
    log-probabilities under raw, in one launch over a one-rank scratch. Ids below 2**53 are
    exact in float64. With `sample_key` row r's token is `reference.inverse_cdf_ref`'s at
    the uniform `reference.uniforms_ref(sample_key, N)[r]`. With `bitmask` the pick is the
    one over the scores with -inf wherever a token's bit (bit t % 32 of word t // 32 of its
    row) is clear; the log-probabilities stay raw's."""
    assert raw.dim() == 2, f"raw must be (rows, vocab), got {tuple(raw.shape)}"
    if scratch is None:
        scratch = PickScratch(raw.shape[0], raw.shape[1], raw.device, block_v or BLOCK_V)
    assert block_v is None or block_v == scratch.block_v, (
        f"block_v {block_v} differs from the scratch's {scratch.block_v}"
    )
    assert scratch.ranks == 1, "a scratch of several ranks picks in two launches around a gather"
    _check_pick_operands(scores, raw, scale, noise)
    assert noise is None or sample_key is None, "a pick races over `noise` or samples by a key"
    assert sample_key is None or 0 <= sample_key < 2**63, f"sample_key {sample_key} not in int64"
    num_rows, vocab_size = raw.shape
    assert vocab_size >= 1, "raw has an empty vocabulary"
    _check_scratch(scratch, raw)
    block_v, num_chunks = scratch.block_v, scratch.num_chunks
    token_ids, packed, parts = scratch.views(num_rows)
    if num_rows == 0:
        return token_ids, packed
    noise_or_scores = scores if noise is None else noise  # never read without noise
    if bitmask is not None:
        _check_bitmask(bitmask, raw)
    pick_kernel[(num_rows, num_chunks)](
        scores,
        raw,
        noise_or_scores,
        scores if bitmask is None else bitmask,  # never read without a bitmask
        parts,
        parts.view(torch.int32),
        scratch.counters,
        token_ids,
        packed,
        scores.stride(0),
        raw.stride(0),
        noise_or_scores.stride(0),
        0 if bitmask is None else bitmask.stride(0),
        num_rows * num_chunks,
        packed.stride(0),
        scale,
        0 if sample_key is None else sample_key,
        VOCAB=vocab_size,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=next_power_of_2(num_chunks),
        BLOCK_V=block_v,
        RULE=_rule(noise, sample_key),
        NOISE_FLOOR=NOISE_FLOOR,
        MASKED=bitmask is not None,
        num_warps=8,
    )
    return token_ids, packed


def _rule(noise: torch.Tensor | None, sample_key: int | None) -> int:
    """The pick kernel's RULE."""
    if sample_key is not None:
        return INVERSE_CDF
    return ARGMAX if noise is None else RACE


def _check_pick_operands(
    scores: torch.Tensor, raw: torch.Tensor, scale: float, noise: torch.Tensor | None
) -> None:
    assert raw.dim() == 2, f"raw must be (rows, vocab), got {tuple(raw.shape)}"
    assert raw.dtype in LOGIT_DTYPES, f"raw is {raw.dtype}, expected one of {LOGIT_DTYPES}"
    check_like("raw", raw, raw)
    assert scores.dtype in (torch.float32, raw.dtype), (
        f"scores is {scores.dtype}, expected torch.float32 or raw's {raw.dtype}"
    )
    check_like("scores", scores, raw, scores.dtype)
    if noise is not None:
        check_like("noise", noise, raw, torch.float32)
    assert math.isfinite(scale) and scale > 0, f"scale {scale} must be finite and positive"


def _check_bitmask(bitmask: torch.Tensor, raw: torch.Tensor) -> None:
    """One row of int32 words a row of raw, a bit for each of its columns."""
    num_rows, vocab_size = raw.shape
    words = triton.cdiv(vocab_size, 32)
    assert bitmask.dtype == torch.int32, f"bitmask is {bitmask.dtype}, expected torch.int32"
    assert bitmask.dim() == 2 and bitmask.shape[0] == num_rows and bitmask.shape[1] >= words, (
        f"bitmask {tuple(bitmask.shape)} does not cover raw's {num_rows} rows of {vocab_size}"
    )
    assert bitmask.stride(1) == 1, "bitmask rows must be contiguous"
    check_device("bitmask", bitmask, raw.device)


def _check_scratch(scratch: PickScratch, raw: torch.Tensor) -> None:
    """The scratch was made for raw's columns, on its device."""
    width = raw.shape[1]
    assert scratch.num_chunks == triton.cdiv(width, scratch.block_v), (
        f"scratch made for {scratch.num_chunks} chunks of {scratch.block_v}, raw has a "
        f"vocabulary of {width}"
    )
    check_device("scratch", scratch.token_ids, raw.device)
