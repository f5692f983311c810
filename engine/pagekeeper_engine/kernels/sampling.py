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
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import NOISE_FLOOR, check_device, check_like, next_power_of_2

BLOCK_V = 2048
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Arguments whose alignment or value changes from step to step (see kernels/__init__.py).
STEP_VARYING = (
    "part_max_ptr",
    "part_sum_ptr",
    "part_best_ptr",
    "part_index_ptr",
    "token_ids_ptr",
    "packed_ptr",
    "packed_row_stride",
)


@triton.jit(do_not_specialize=STEP_VARYING)
def _chunk_partials_kernel(
    scores_ptr,
    raw_ptr,
    noise_ptr,
    part_max_ptr,  # (N, NUM_CHUNKS) fp32: max of raw over the chunk
    part_sum_ptr,  # (N, NUM_CHUNKS) fp32: sum of exp(raw - that max)
    part_best_ptr,  # (N, NUM_CHUNKS) fp32: best race score
    part_index_ptr,  # (N, NUM_CHUNKS) int32: its lowest vocabulary index
    scores_row_stride,
    raw_row_stride,
    noise_row_stride,
    scale,
    VOCAB: tl.constexpr,
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
    best_index = tl.min(tl.where((score == best) & mask, offs, VOCAB), axis=0)

    part = row * NUM_CHUNKS + chunk
    tl.store(part_max_ptr + part, raw_max)
    tl.store(part_sum_ptr + part, raw_sum)
    tl.store(part_best_ptr + part, best)
    tl.store(part_index_ptr + part, best_index)


@triton.jit(do_not_specialize=STEP_VARYING)
def _combine_chunks_kernel(
    raw_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_best_ptr,
    part_index_ptr,
    token_ids_ptr,  # (N,) int64
    packed_ptr,  # (2, N) float64: ids, then log-probabilities
    raw_row_stride,
    packed_row_stride,
    VOCAB: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < NUM_CHUNKS
    parts = row * NUM_CHUNKS + offs
    chunk_max = tl.load(part_max_ptr + parts, mask=mask, other=float("-inf"))
    chunk_sum = tl.load(part_sum_ptr + parts, mask=mask, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    # Padding and all -inf chunks weigh exp(-inf) = 0.
    lse = row_max + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - row_max), axis=0))

    chunk_best = tl.load(part_best_ptr + parts, mask=mask, other=float("-inf"))
    chunk_index = tl.load(part_index_ptr + parts, mask=mask, other=VOCAB)
    best = tl.max(chunk_best, axis=0)
    # Chunk 0 always ties an all -inf row, so -inf never beats a finite score and such a row
    # picks index 0, as torch.argmax does. Only an all-NaN row matches no chunk: the clamp keeps
    # the read below in bounds.
    token = tl.min(tl.where(chunk_best == best, chunk_index, VOCAB - 1), axis=0)
    logprob = tl.load(raw_ptr + row * raw_row_stride + token).to(tl.float32) - lse

    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(packed_ptr + row, token.to(tl.float64))
    tl.store(packed_ptr + packed_row_stride + row, logprob.to(tl.float64))


class PickScratch:
    """The pick's outputs and per-chunk partials for up to `max_rows` rows of a `vocab_size`
    vocabulary, allocated once: a step's pick works in their leading rows and allocates
    nothing. A step's ids and packed results stay valid until the next pick over the same
    scratch is enqueued (stream order)."""

    def __init__(
        self, max_rows: int, vocab_size: int, device: torch.device | str, block_v: int = BLOCK_V
    ) -> None:
        self.max_rows = max_rows
        self.block_v = block_v
        self.num_chunks = triton.cdiv(vocab_size, block_v) if vocab_size else 0
        self.token_ids = torch.empty(max_rows, dtype=torch.int64, device=device)
        self.packed = torch.empty(2 * max_rows, dtype=torch.float64, device=device)
        self.parts = torch.empty(3 * max_rows * self.num_chunks, dtype=torch.float32, device=device)
        self.part_index = torch.empty(max_rows * self.num_chunks, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        planes = (self.token_ids, self.packed, self.parts, self.part_index)
        return sum(t.nbytes for t in planes)

    def views(
        self, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids (N,), packed (2, N) contiguous, part max / sum / best (N, C) fp32 and part
        index (N, C) int32 for N = `num_rows`."""
        assert num_rows <= self.max_rows, f"{num_rows} rows exceed the scratch's {self.max_rows}"
        rows, chunks = num_rows, self.num_chunks
        size = rows * chunks
        part_max, part_sum, part_best = self.parts[: 3 * size].view(3, rows, chunks).unbind(0)
        return (
            self.token_ids[:rows],
            self.packed[: 2 * rows].view(2, rows),
            part_max,
            part_sum,
            part_best,
            self.part_index[:size].view(rows, chunks),
        )


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
    assert raw.dtype in LOGIT_DTYPES, f"raw is {raw.dtype}, expected one of {LOGIT_DTYPES}"
    check_like("raw", raw, raw)
    assert scores.dtype in (torch.float32, raw.dtype), (
        f"scores is {scores.dtype}, expected torch.float32 or raw's {raw.dtype}"
    )
    check_like("scores", scores, raw, scores.dtype)
    if noise is not None:
        check_like("noise", noise, raw, torch.float32)
    assert math.isfinite(scale) and scale > 0, f"scale {scale} must be finite and positive"
    num_rows, vocab_size = raw.shape
    assert vocab_size >= 1, "raw has an empty vocabulary"
    if scratch is None:
        scratch = PickScratch(num_rows, vocab_size, raw.device, block_v or BLOCK_V)
    assert block_v is None or block_v == scratch.block_v, (
        f"block_v {block_v} differs from the scratch's {scratch.block_v}"
    )
    block_v, num_chunks = scratch.block_v, scratch.num_chunks
    assert block_v >= 16 and block_v & (block_v - 1) == 0, f"block_v {block_v} not a power of 2"
    assert num_chunks == triton.cdiv(vocab_size, block_v), (
        f"scratch made for {num_chunks} chunks of {block_v}, raw has a vocabulary of {vocab_size}"
    )
    check_device("scratch", scratch.token_ids, raw.device)
    token_ids, packed, part_max, part_sum, part_best, part_index = scratch.views(num_rows)
    if num_rows == 0:
        return token_ids, packed

    noise_or_scores = scores if noise is None else noise  # never read without noise
    _chunk_partials_kernel[(num_rows, num_chunks)](
        scores,
        raw,
        noise_or_scores,
        part_max,
        part_sum,
        part_best,
        part_index,
        scores.stride(0),
        raw.stride(0),
        noise_or_scores.stride(0),
        scale,
        VOCAB=vocab_size,
        NUM_CHUNKS=num_chunks,
        BLOCK_V=block_v,
        HAS_NOISE=noise is not None,
        NOISE_FLOOR=NOISE_FLOOR,
        num_warps=8,
    )
    _combine_chunks_kernel[(num_rows,)](
        raw,
        part_max,
        part_sum,
        part_best,
        part_index,
        token_ids,
        packed,
        raw.stride(0),
        packed.stride(0),
        VOCAB=vocab_size,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=next_power_of_2(num_chunks),
        num_warps=1,
    )
    return token_ids, packed
