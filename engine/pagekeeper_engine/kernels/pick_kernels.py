# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The token pick's Triton code (`kernels/sampling.py` launches it): a chunk's partials, a
row's merge of its chunks' partials, and the one-rank pick that runs both in one launch.

A program of the chunk stage reads BLOCK_V columns of one row and stores the PLANES partials
(`pick_scratch.py`). The merge reads every chunk of a row (of every rank, under tensor
parallelism) and writes the row's token id and its (id, log-probability) pair. In the one-rank
pick each chunk's program counts itself in on its row's counter after its stores; the program
that counts last merges the row and zeroes the counter again. Where the one-rank pick is given
the schemas' token bitmask (MASKED), a score whose token's bit is clear reads as -inf: the pick
applies the mask as it reads the scores, so no pass of its own writes them first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagekeeper_engine.kernels.pick_scratch import PLANES

# The planes, in order (jit code reads module globals only as constexprs).
_MAX, _SUM, _BEST, _RAW_AT_BEST, _INDEX = (tl.constexpr(plane) for plane in range(PLANES))

# How a pick chooses (its RULE argument): the argmax of the scores (greedy), the argmax of the
# race scores * scale - log E over a tensor of Exp(1) draws E, or the inverse of the row's
# softmax(scores * scale) CDF at one uniform draw per row, drawn in the kernel from a key.
ARGMAX, RACE, INVERSE_CDF = 0, 1, 2
_RACE, _INVERSE_CDF = tl.constexpr(RACE), tl.constexpr(INVERSE_CDF)


# Arguments whose alignment or value changes from step to step (see kernels/__init__.py).
_PARTS_VARYING = ("parts_ptr", "index_ptr", "plane_stride")
_COMBINE_VARYING = (
    *_PARTS_VARYING,
    "rank_stride",
    "token_ids_ptr",
    "packed_ptr",
    "packed_row_stride",
)
_PICK_VARYING = (
    *_PARTS_VARYING,
    "token_ids_ptr",
    "packed_ptr",
    "packed_row_stride",
    "key",
)


@triton.jit
def _load_scores(
    scores_ptr,
    bitmask_ptr,
    row,
    cols,
    col_mask,
    scores_row_stride,
    bitmask_row_stride,
    MASKED: tl.constexpr,
):
    """Row `row`'s scores at `cols` in fp32, -inf where `col_mask` is off and, under MASKED,
    where the token's bit (bit t % 32 of int32 word t // 32 of the row) is clear."""
    score = tl.load(scores_ptr + row * scores_row_stride + cols, mask=col_mask, other=float("-inf"))
    score = score.to(tl.float32)
    if MASKED:
        words = tl.load(bitmask_ptr + row * bitmask_row_stride + cols // 32, mask=col_mask, other=0)
        allowed = ((words >> (cols % 32)) & 1) != 0
        score = tl.where(allowed, score, float("-inf"))
    return score


@triton.jit
def _store_chunk_partials(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    bitmask_ptr,
    parts_ptr,
    index_ptr,
    row,
    chunk,
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    bitmask_row_stride,
    plane_stride,
    scale,
    VOCAB: tl.constexpr,
    INDEX_OFFSET: tl.constexpr,
    NO_INDEX: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    RULE: tl.constexpr,
    NOISE_FLOOR: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Chunk `chunk` of row `row`: its PLANES partials, stored at (row, chunk) of each plane.
    Under INVERSE_CDF the BEST plane holds the chunk's largest score * scale and the
    RAW_AT_BEST plane the sum of exp(score * scale - that), its share of the row's softmax
    mass; the INDEX plane is not written."""
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < VOCAB
    raw = tl.load(raw_ptr + row * raw_row_stride + offs, mask=mask, other=float("-inf"))
    raw = raw.to(tl.float32)
    raw_max = tl.max(raw, axis=0)
    # A chunk of -inf logits sums to exp(-inf) = 0 rather than to exp(-inf - -inf) = NaN.
    shift = tl.where(raw_max == float("-inf"), 0.0, raw_max)
    raw_sum = tl.sum(tl.exp(raw - shift), axis=0)

    score = _load_scores(
        scores_ptr, bitmask_ptr, row, offs, mask, scores_row_stride, bitmask_row_stride, MASKED
    )
    score = score * scale
    part = row * NUM_CHUNKS + chunk
    tl.store(parts_ptr + _MAX * plane_stride + part, raw_max)
    tl.store(parts_ptr + _SUM * plane_stride + part, raw_sum)
    if RULE == _INVERSE_CDF:
        best = tl.max(score, axis=0)
        best_shift = tl.where(best == float("-inf"), 0.0, best)
        tl.store(parts_ptr + _BEST * plane_stride + part, best)
        tl.store(parts_ptr + _RAW_AT_BEST * plane_stride + part, tl.sum(tl.exp(score - best_shift)))
    else:
        if RULE == _RACE:
            noise = tl.load(noise_ptr + row * noise_row_stride + offs, mask=mask, other=1.0)
            score = score - tl.log(tl.maximum(noise, NOISE_FLOOR))
        best = tl.max(score, axis=0)
        # `mask`: a padding lane never wins, even in a chunk whose scores are all -inf.
        best_local = tl.min(tl.where((score == best) & mask, offs, VOCAB), axis=0)
        raw_at_best = tl.max(tl.where(offs == best_local, raw, float("-inf")), axis=0)
        best_index = tl.where(best_local < VOCAB, best_local + INDEX_OFFSET, NO_INDEX)
        tl.store(parts_ptr + _BEST * plane_stride + part, best)
        tl.store(parts_ptr + _RAW_AT_BEST * plane_stride + part, raw_at_best)
        tl.store(index_ptr + _INDEX * plane_stride + part, best_index.to(tl.int32))


@triton.jit(do_not_specialize=_PARTS_VARYING)
def chunk_partials_kernel(
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
    RULE: tl.constexpr,  # ARGMAX or RACE: the merge across ranks takes their partials
    NOISE_FLOOR: tl.constexpr,
):
    _store_chunk_partials(
        scores_ptr, raw_ptr, noise_ptr, scores_ptr, parts_ptr, index_ptr,
        tl.program_id(0).to(tl.int64), tl.program_id(1),
        scores_row_stride, raw_row_stride, noise_row_stride, 0, plane_stride, scale,
        VOCAB, INDEX_OFFSET, NO_INDEX, NUM_CHUNKS, BLOCK_V, RULE, NOISE_FLOOR, False,
    )  # fmt: skip


@triton.jit
def _row_lse(parts_ptr, parts, mask, plane_stride):
    """The row's log-sum-exp of the raw logits, from its chunks' (max, sum) partials."""
    chunk_max = tl.load(parts_ptr + _MAX * plane_stride + parts, mask=mask, other=float("-inf"))
    chunk_sum = tl.load(parts_ptr + _SUM * plane_stride + parts, mask=mask, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    # Padding and all -inf chunks weigh exp(-inf) = 0.
    return row_max + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - row_max), axis=0))


@triton.jit
def _combine_row(
    parts_ptr,
    index_ptr,
    token_ids_ptr,
    packed_ptr,
    row,
    plane_stride,
    rank_stride,
    packed_row_stride,
    VOCAB: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    RANKS: tl.constexpr,
    RANKS_PAD: tl.constexpr,
):
    """Row `row`'s token and log-probability, merged from every rank's chunk partials."""
    offs = tl.arange(0, RANKS_PAD * CHUNKS_PAD)
    rank = offs // CHUNKS_PAD
    chunk = offs % CHUNKS_PAD
    mask = (rank < RANKS) & (chunk < NUM_CHUNKS)
    parts = rank.to(tl.int64) * rank_stride + row * NUM_CHUNKS + chunk
    lse = _row_lse(parts_ptr, parts, mask, plane_stride)
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


@triton.jit(do_not_specialize=_COMBINE_VARYING)
def combine_chunks_kernel(
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
    _combine_row(
        parts_ptr, index_ptr, token_ids_ptr, packed_ptr, tl.program_id(0).to(tl.int64),
        plane_stride, rank_stride, packed_row_stride,
        VOCAB, NUM_CHUNKS, CHUNKS_PAD, RANKS, RANKS_PAD,
    )  # fmt: skip


@triton.jit
def _sample_row(
    scores_ptr,
    raw_ptr,
    bitmask_ptr,
    parts_ptr,
    token_ids_ptr,
    packed_ptr,
    row,
    scores_row_stride,
    raw_row_stride,
    bitmask_row_stride,
    plane_stride,
    packed_row_stride,
    scale,
    key,
    VOCAB: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Row `row`'s token under INVERSE_CDF: U = `tl.rand(key, row)`, uniform in [0, 1), and
    the token is the first whose cumulative softmax(scores * scale) mass exceeds U times the
    row's mass: the chunk where that happens from the chunks' masses, then the token inside it
    from that chunk's scores, read again (`reference.inverse_cdf_ref`). A token of zero mass
    (a score of -inf) is never picked; where rounding leaves the target past the last
    cumulative mass, the last token with mass is; a row of no mass at all picks token 0, as
    the argmax of an all -inf row does."""
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < NUM_CHUNKS
    parts = row * NUM_CHUNKS + offs
    lse = _row_lse(parts_ptr, parts, mask, plane_stride)
    chunk_best = tl.load(parts_ptr + _BEST * plane_stride + parts, mask=mask, other=float("-inf"))
    chunk_sum = tl.load(parts_ptr + _RAW_AT_BEST * plane_stride + parts, mask=mask, other=0.0)
    best = tl.max(chunk_best, axis=0)
    shift = tl.where(best == float("-inf"), 0.0, best)
    mass = chunk_sum * tl.exp(chunk_best - shift)  # each chunk's, on the row's scale
    target = tl.rand(key, row) * tl.sum(mass, axis=0)
    past = (tl.cumsum(mass, axis=0) > target) & (mass > 0)
    chunk = tl.min(tl.where(past, offs, CHUNKS_PAD), axis=0)
    last_with_mass = tl.max(tl.where(mass > 0, offs, 0), axis=0)
    chunk = tl.where(chunk == CHUNKS_PAD, last_with_mass, chunk)
    # The target's place inside the chunk, as a share of the chunk's own mass: its tokens'
    # masses are summed again below, in another order, and need not round to the same total.
    before = tl.sum(tl.where(offs < chunk, mass, 0.0), axis=0)
    chunk_mass = tl.sum(tl.where(offs == chunk, mass, 0.0), axis=0)
    share = (target - before) / tl.where(chunk_mass > 0, chunk_mass, 1.0)  # 0 in a massless row

    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < VOCAB
    score = _load_scores(
        scores_ptr, bitmask_ptr, row, cols, col_mask, scores_row_stride, bitmask_row_stride, MASKED
    )
    weight = tl.exp(score * scale - shift)  # -inf scores weigh 0
    running = tl.cumsum(weight, axis=0)
    inside = share * tl.sum(weight, axis=0)
    hit = (running > inside) & (weight > 0)
    token = tl.min(tl.where(hit, cols, VOCAB), axis=0)
    last_token = tl.max(tl.where(weight > 0, cols, 0), axis=0)
    token = tl.where(token == VOCAB, last_token, token)
    token = tl.minimum(token, VOCAB - 1)  # an all-NaN row matches nothing
    raw = tl.load(raw_ptr + row * raw_row_stride + token).to(tl.float32)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(packed_ptr + row, token.to(tl.float64))
    tl.store(packed_ptr + packed_row_stride + row, (raw - lse).to(tl.float64))


@triton.jit(do_not_specialize=_PICK_VARYING)
def pick_kernel(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    bitmask_ptr,  # MASKED: (N, ceil(VOCAB / 32)) int32 rows of allowed tokens' bits
    parts_ptr,  # (PLANES, N, NUM_CHUNKS) fp32
    index_ptr,  # the same memory as int32
    counters_ptr,  # (>= N,) int32, zero before the launch and after it
    token_ids_ptr,  # (N,) int64
    packed_ptr,  # (2, N) float64: ids, then log-probabilities
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    bitmask_row_stride,
    plane_stride,  # N * NUM_CHUNKS
    packed_row_stride,
    scale,
    key,  # INVERSE_CDF: the Philox key of the launch's uniform draws, one a row
    VOCAB: tl.constexpr,  # the whole vocabulary (one rank reads all of it)
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    RULE: tl.constexpr,
    NOISE_FLOOR: tl.constexpr,
    MASKED: tl.constexpr,  # the scores are read through the bitmask
):
    row = tl.program_id(0).to(tl.int64)
    _store_chunk_partials(
        scores_ptr, raw_ptr, noise_ptr, bitmask_ptr, parts_ptr, index_ptr, row, tl.program_id(1),
        scores_row_stride, raw_row_stride, noise_row_stride, bitmask_row_stride, plane_stride,
        scale, VOCAB, 0, VOCAB, NUM_CHUNKS, BLOCK_V, RULE, NOISE_FLOOR, MASKED,
    )  # fmt: skip
    # Every thread's partial stores precede the counter's release (barrier, then an acq_rel
    # atomic at GPU scope); the chunk that counts last acquires all of its row's.
    tl.debug_barrier()
    counter = counters_ptr + row
    num_done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if num_done == NUM_CHUNKS - 1:
        if RULE == _INVERSE_CDF:
            _sample_row(
                scores_ptr, raw_ptr, bitmask_ptr, parts_ptr, token_ids_ptr, packed_ptr, row,
                scores_row_stride, raw_row_stride, bitmask_row_stride, plane_stride,
                packed_row_stride, scale, key, VOCAB, NUM_CHUNKS, CHUNKS_PAD, BLOCK_V, MASKED,
            )  # fmt: skip
        else:
            _combine_row(
                parts_ptr, index_ptr, token_ids_ptr, packed_ptr, row,
                plane_stride, 0, packed_row_stride,
                VOCAB, NUM_CHUNKS, CHUNKS_PAD, 1, 1,
            )  # fmt: skip
        tl.store(counter, 0)  # zero again for the next launch (stream-ordered)
