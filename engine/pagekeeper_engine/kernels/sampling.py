# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The sampler's last step, fused: each row's token and its log-probability in two launches.

    token   = argmax_v (scores[v] * scale - log(max(noise[v], NOISE_FLOOR)))   (ties: lowest)
    logprob = raw[token] - logsumexp(raw)

all in fp32, whatever the dtypes the operands are stored in: the logits may be read in the
model's dtype (bf16 / fp16), widened in registers, so that no step copies them to fp32 first.

Without noise it is the greedy argmax. With scale = 1 / T and noise E ~ Exp(1) it is the
exponential race (the Gumbel-max trick: -log E is Gumbel-distributed), which samples exactly
from softmax(scores / T).

Why: on an H200, at batch 1, torch's sampler cost ~120 us of a ~4.6 ms decode step of an 8B
model. Its softmax over a 128,256-entry vocabulary runs one thread block per row (33 us at one
row), argmax 28 us, logsumexp ~28 us, plus ~10 small elementwise kernels: a row is processed by
one SM. Here each row's vocabulary is split into BLOCK_V chunks, one program each (63 per row at
128,256), which write their running max and sum of exp for the logsumexp and their best score
and its index; a second kernel, one program per row, merges the chunks and writes the token ids
and the (2, N) float64 [ids; log-probabilities] the runner copies to the host.

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
import triton.language as tl

from pagekeeper_engine.kernels import NOISE_FLOOR, check_device, check_like, next_power_of_2
from pagekeeper_engine.kernels.pick_scratch import BLOCK_V, PLANES, PickScratch

__all__ = ["BLOCK_V", "PLANES", "PickScratch", "chunk_partials", "combine_partials", "pick_tokens"]

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The planes, in order (jit code reads module globals only as constexprs).
_MAX, _SUM, _BEST, _RAW_AT_BEST, _INDEX = (tl.constexpr(plane) for plane in range(PLANES))


# Arguments whose alignment or value changes from step to step (see kernels/__init__.py).
_PARTS_VARYING = ("parts_ptr", "index_ptr", "plane_stride")
_COMBINE_VARYING = (
    *_PARTS_VARYING,
    "rank_stride",
    "token_ids_ptr",
    "packed_ptr",
    "packed_row_stride",
)


@triton.jit(do_not_specialize=_PARTS_VARYING)
def _chunk_partials_kernel(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    parts_ptr,  # (PLANES, N, NUM_CHUNKS) fp32
    index_ptr,  # the same memory as int32: plane _INDEX holds the best indices
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    plane_stride,  # N * NUM_CHUNKS
    scale,
    VOCAB: tl.constexpr,  # the columns read: the (shard's) valid vocabulary
    INDEX_OFFSET: tl.constexpr,  # column 0's index in the whole vocabulary
    NO_INDEX: tl.constexpr,  # the whole vocabulary's size: a chunk with no valid column
    NUM_CHUNKS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    NOISE_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < VOCAB
    raw = tl.load(raw_ptr + row * raw_row_stride + offs, mask=mask, other=float("-inf"))
    raw = raw.to(tl.float32)
    raw_max = tl.max(raw, axis=0)
    # A chunk of -inf logits sums to exp(-inf) = 0 rather than to exp(-inf - -inf) = NaN.
    shift = tl.where(raw_max == float("-inf"), 0.0, raw_max)
    raw_sum = tl.sum(tl.exp(raw - shift), axis=0)

    score = tl.load(scores_ptr + row * scores_row_stride + offs, mask=mask, other=float("-inf"))
    score = score.to(tl.float32) * scale
    if HAS_NOISE:
        noise = tl.load(noise_ptr + row * noise_row_stride + offs, mask=mask, other=1.0)
        score = score - tl.log(tl.maximum(noise, NOISE_FLOOR))
    best = tl.max(score, axis=0)
    # `mask`: a padding lane never wins, even in a chunk whose scores are all -inf.
    best_local = tl.min(tl.where((score == best) & mask, offs, VOCAB), axis=0)
    raw_at_best = tl.max(tl.where(offs == best_local, raw, float("-inf")), axis=0)
    best_index = tl.where(best_local < VOCAB, best_local + INDEX_OFFSET, NO_INDEX)

    part = row * NUM_CHUNKS + chunk
    tl.store(parts_ptr + _MAX * plane_stride + part, raw_max)
    tl.store(parts_ptr + _SUM * plane_stride + part, raw_sum)
    tl.store(parts_ptr + _BEST * plane_stride + part, best)
    tl.store(parts_ptr + _RAW_AT_BEST * plane_stride + part, raw_at_best)
    tl.store(index_ptr + _INDEX * plane_stride + part, best_index.to(tl.int32))


@triton.jit(do_not_specialize=_COMBINE_VARYING)
def _combine_chunks_kernel(
    parts_ptr,  # (RANKS, PLANES, N, NUM_CHUNKS) fp32
    index_ptr,  # the same memory as int32
    token_ids_ptr,  # (N,) int64
    packed_ptr,  # (2, N) float64: ids, then log-probabilities
    plane_stride,
    rank_stride,
    packed_row_stride,
    VOCAB: tl.constexpr,  # the whole vocabulary's size
    NUM_CHUNKS: tl.constexpr,  # a rank's
    CHUNKS_PAD: tl.constexpr,
    RANKS: tl.constexpr,
    RANKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, RANKS_PAD * CHUNKS_PAD)
    rank = offs // CHUNKS_PAD
    chunk = offs % CHUNKS_PAD
    mask = (rank < RANKS) & (chunk < NUM_CHUNKS)
    parts = rank.to(tl.int64) * rank_stride + row * NUM_CHUNKS + chunk
    chunk_max = tl.load(parts_ptr + _MAX * plane_stride + parts, mask=mask, other=float("-inf"))
    chunk_sum = tl.load(parts_ptr + _SUM * plane_stride + parts, mask=mask, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    # Padding and all -inf chunks weigh exp(-inf) = 0.
    lse = row_max + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - row_max), axis=0))

    chunk_best = tl.load(parts_ptr + _BEST * plane_stride + parts, mask=mask, other=float("-inf"))
    chunk_raw = tl.load(parts_ptr + _RAW_AT_BEST * plane_stride + parts, mask=mask, other=0.0)
    chunk_index = tl.load(index_ptr + _INDEX * plane_stride + parts, mask=mask, other=VOCAB)
    best = tl.max(chunk_best, axis=0)
    # Rank 0's chunk 0 always ties an all -inf row (its index 0, below every padding chunk's
    # VOCAB), so -inf never beats a finite score and such a row picks index 0, as torch.argmax
    # does. Only an all-NaN row matches no chunk: the clamp keeps the token in range.
    token = tl.min(tl.where(chunk_best == best, chunk_index, VOCAB - 1), axis=0)
    token = tl.minimum(token, VOCAB - 1)
    raw = tl.max(tl.where(chunk_index == token, chunk_raw, float("-inf")), axis=0)
    logprob = raw - lse

    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(packed_ptr + row, token.to(tl.float64))
    tl.store(packed_ptr + packed_row_stride + row, logprob.to(tl.float64))


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
    num_rows, width = raw.shape
    valid = width if valid is None else valid
    vocab_size = width if vocab_size is None else vocab_size
    assert 0 <= valid <= width, f"valid {valid} outside the {width} columns"
    assert index_offset >= 0 and index_offset + valid <= vocab_size, (
        f"columns [{index_offset}, {index_offset + valid}) outside a vocabulary of {vocab_size}"
    )
    assert vocab_size >= 1, "raw has an empty vocabulary"
    block_v, num_chunks = scratch.block_v, scratch.num_chunks
    assert block_v >= 16 and block_v & (block_v - 1) == 0, f"block_v {block_v} not a power of 2"
    assert num_chunks == triton.cdiv(width, block_v), (
        f"scratch made for {num_chunks} chunks of {block_v}, raw has a vocabulary of {width}"
    )
    check_device("scratch", scratch.token_ids, raw.device)
    _, _, parts = scratch.views(num_rows)
    if num_rows == 0:
        return parts
    noise_or_scores = scores if noise is None else noise  # never read without noise
    _chunk_partials_kernel[(num_rows, num_chunks)](
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
        HAS_NOISE=noise is not None,
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
    _combine_chunks_kernel[(num_rows,)](
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
    scratch: PickScratch | None = None,  # where the results go; default: new tensors
    block_v: int | None = None,  # vocabulary entries a program reads; default: the scratch's
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the token ids (N,) int64 and the packed (2, N) float64: the same ids, then their
    log-probabilities under raw. Ids below 2**53 are exact in float64."""
    assert raw.dim() == 2, f"raw must be (rows, vocab), got {tuple(raw.shape)}"
    if scratch is None:
        scratch = PickScratch(raw.shape[0], raw.shape[1], raw.device, block_v or BLOCK_V)
    assert block_v is None or block_v == scratch.block_v, (
        f"block_v {block_v} differs from the scratch's {scratch.block_v}"
    )
    parts = chunk_partials(scores, raw, scale=scale, noise=noise, scratch=scratch)
    return combine_partials(parts[None], scratch, raw.shape[1])
