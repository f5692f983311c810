# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The token pick's Triton code (`kernels/sampling.py` launches it): a chunk's partials, a
row's merge of its chunks' partials, and the one-rank pick that runs both in one launch.

A program of the chunk stage reads BLOCK_V columns of one row and stores the PLANES partials
(`pick_scratch.py`). The merge reads every chunk of a row (of every rank, under tensor
parallelism) and writes the row's token id and its (id, log-probability) pair. In the one-rank
pick each chunk's program counts itself in on its row's counter after its stores; the program
that counts last merges the row and zeroes the counter again.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagekeeper_engine.kernels.pick_scratch import PLANES

# The planes, in order (jit code reads module globals only as constexprs).
_MAX, _SUM, _BEST, _RAW_AT_BEST, _INDEX = (tl.constexpr(plane) for plane in range(PLANES))

# Where a pick's Exp(1) draws come from (its NOISE argument): none (greedy), a tensor of them,
# or drawn in the kernel from a seed (`exp_draws`).
NO_NOISE, NOISE_TENSOR, NOISE_DRAWN = 0, 1, 2
_NOISE_TENSOR, _NOISE_DRAWN = tl.constexpr(NOISE_TENSOR), tl.constexpr(NOISE_DRAWN)


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
    "noise_seed",
)


@triton.jit
def exp_draws(seed, row, first_column, row_counters, BLOCK_V: tl.constexpr):
    """Exp(1) draws for columns first_column..+BLOCK_V of row `row`: E = -log(U), U uniform in
    [0, 1) from Philox4x32-10 keyed by `seed`. Column c of row r takes lane c % 4 of the
    counter r * row_counters + c // 4 (`row_counters` = ceil(vocabulary / 4)), so a draw
    depends on the seed, the row and the column alone, not on the chunking
    (`reference.exp_draws_ref`). One counter feeds four columns: a quarter of the rounds of a
    draw each. U = 0 gives E = inf, a column that never wins (probability 2**-31)."""
    quads = row * row_counters + first_column // 4 + tl.arange(0, BLOCK_V // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, quads)
    # join stacks on a new last axis: (q, i, j) holds lane 2i + j of quad q
    bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_V])
    return -tl.log(tl.random.uint_to_uniform_float(bits))


@triton.jit
def _store_chunk_partials(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    parts_ptr,
    index_ptr,
    row,
    chunk,
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    plane_stride,
    scale,
    noise_seed,
    VOCAB: tl.constexpr,
    INDEX_OFFSET: tl.constexpr,
    NO_INDEX: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NOISE: tl.constexpr,
    NOISE_FLOOR: tl.constexpr,
):
    """Chunk `chunk` of row `row`: its PLANES partials, stored at (row, chunk) of each plane."""
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
    if NOISE == _NOISE_TENSOR:
        noise = tl.load(noise_ptr + row * noise_row_stride + offs, mask=mask, other=1.0)
        score = score - tl.log(tl.maximum(noise, NOISE_FLOOR))
    elif NOISE == _NOISE_DRAWN:
        noise = exp_draws(noise_seed, row, chunk * BLOCK_V, (VOCAB + 3) // 4, BLOCK_V)
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
    NOISE: tl.constexpr,  # NO_NOISE or NOISE_TENSOR (a shard's draws come in a tensor)
    NOISE_FLOOR: tl.constexpr,
):
    _store_chunk_partials(
        scores_ptr, raw_ptr, noise_ptr, parts_ptr, index_ptr,
        tl.program_id(0).to(tl.int64), tl.program_id(1),
        scores_row_stride, raw_row_stride, noise_row_stride, plane_stride, scale, 0,
        VOCAB, INDEX_OFFSET, NO_INDEX, NUM_CHUNKS, BLOCK_V, NOISE, NOISE_FLOOR,
    )  # fmt: skip


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


@triton.jit(do_not_specialize=_PICK_VARYING)
def pick_kernel(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    parts_ptr,  # (PLANES, N, NUM_CHUNKS) fp32
    index_ptr,  # the same memory as int32
    counters_ptr,  # (>= N,) int32, zero before the launch and after it
    token_ids_ptr,  # (N,) int64
    packed_ptr,  # (2, N) float64: ids, then log-probabilities
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    plane_stride,  # N * NUM_CHUNKS
    packed_row_stride,
    scale,
    noise_seed,  # NOISE_DRAWN: the Philox key of the launch's draws
    VOCAB: tl.constexpr,  # the whole vocabulary (one rank reads all of it)
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NOISE: tl.constexpr,
    NOISE_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _store_chunk_partials(
        scores_ptr, raw_ptr, noise_ptr, parts_ptr, index_ptr, row, tl.program_id(1),
        scores_row_stride, raw_row_stride, noise_row_stride, plane_stride, scale, noise_seed,
        VOCAB, 0, VOCAB, NUM_CHUNKS, BLOCK_V, NOISE, NOISE_FLOOR,
    )  # fmt: skip
    # Every thread's partial stores precede the counter's release (barrier, then an acq_rel
    # atomic at GPU scope); the chunk that counts last acquires all of its row's.
    tl.debug_barrier()
    counter = counters_ptr + row
    num_done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if num_done == NUM_CHUNKS - 1:
        _combine_row(
            parts_ptr, index_ptr, token_ids_ptr, packed_ptr, row,
            plane_stride, 0, packed_row_stride,
            VOCAB, NUM_CHUNKS, CHUNKS_PAD, 1, 1,
        )  # fmt: skip
        tl.store(counter, 0)  # zero again for the next launch (stream-ordered)
