"""The token pick on either device: the Triton kernel on CUDA (`kernels/sampling.py`), its
torch reference in fp32 on the CPU, which is also what the kernel's tests check it against; and
the race's draws for seeded rows (`seeded_key`, `draw_seeded_noise`)."""

from __future__ import annotations

import torch

from pagekeeper_engine.kernels import NOISE_FLOOR
from pagekeeper_engine.kernels.pick_scratch import PickScratch
from pagekeeper_engine.runner.structured_output import unpack_bitmask


def pick_tokens_ref(
    scores: torch.Tensor,  # (N, V) fp32 or raw's dtype
    raw: torch.Tensor,  # (N, V) fp32, bf16 or fp16: the model's unmodified logits
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,  # (N, V) fp32 Exp(1) draws, each >= 0
    bitmask: torch.Tensor | None = None,  # (N, ceil(V / 32)) int32: the allowed tokens' bits
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sampling.pick_tokens` in plain torch, in fp32: the CPU path and the kernel's
    reference."""
    race = scores.float() * scale
    if bitmask is not None:
        race = race.masked_fill(~unpack_bitmask(bitmask, raw.shape[1]), float("-inf"))
    if noise is not None:
        race = race - noise.clamp(min=NOISE_FLOOR).log()
    token_ids = race.argmax(dim=-1)  # ties: the lowest index
    raw = raw.float()
    logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - raw.logsumexp(dim=-1)
    return token_ids, torch.stack((token_ids.double(), logprobs.double()))


def pick_tokens(
    scores: torch.Tensor,
    raw: torch.Tensor,
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,
    sample_key: int | None = None,  # instead of `noise`: invert the CDF at this key's draws
    scratch: PickScratch | None = None,
    bitmask: torch.Tensor | None = None,  # (N, ceil(V / 32)) int32: the allowed tokens' bits
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], left on the device (in
    `scratch` where given); with `bitmask`, picked as if every score whose bit is clear were
    -inf."""
    if not raw.is_cuda:
        assert sample_key is None, "a keyed pick runs in the CUDA kernel; the CPU's races"
        return pick_tokens_ref(scores, raw, scale=scale, noise=noise, bitmask=bitmask)
    # Imported on first CUDA use: a kernel module fixes interpreted or native mode
    # (`TRITON_INTERPRET`) when it is imported, and the CPU path needs no triton.
    from pagekeeper_engine.kernels import sampling  # noqa: PLC0415

    return sampling.pick_tokens(
        scores,
        raw,
        scale=scale,
        noise=noise,
        sample_key=sample_key,
        scratch=scratch,
        bitmask=bitmask,
    )


_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit words that spreads every input bit over the
    output."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, num_output_tokens: int) -> int:
    """The Philox key of a seeded request's draws for its next token, in [0, 2**63): a function
    of its seed (read as 64 bits) and of how many tokens it has generated, so the request's
    tokens depend neither on what else is in the batch nor on a preemption that recomputes it."""
    return _mix64(_mix64(seed & _MASK64) ^ num_output_tokens) >> 1


def draw_seeded_noise(
    noise: torch.Tensor,  # (R, >= width) fp32: the race's draws, these rows rewritten
    rows: list[int],
    seeds: list[int],  # each row's request's seed
    num_output_tokens: list[int],  # and its tokens so far
    col_offset: int,  # column 0's index in the whole vocabulary (a shard's start)
    width: int,  # the columns drawn
    vocab_size: int,  # the whole vocabulary's
) -> None:
    """The seeded rows' Exp(1) draws over columns 0..width-1, the same whichever rank's shard
    of the vocabulary they are: on CUDA by each row's `seeded_key`, all rows in one launch
    (`kernels/seeded_noise.py`); on the CPU from a generator seeded with `seed +
    num_output_tokens` over the whole vocabulary's row (a keyed draw there costs seconds a
    step at a real vocabulary)."""
    assert len(rows) == len(seeds) == len(num_output_tokens), "a seed and a length a row"
    if noise.is_cuda:
        # Imported on first CUDA use, as the pick's kernel is (see `pick_tokens`).
        from pagekeeper_engine.kernels import seeded_noise  # noqa: PLC0415

        keys = [seeded_key(s, n) for s, n in zip(seeds, num_output_tokens, strict=True)]
        seeded_noise.seeded_noise(noise, rows, keys, col_offset, width)
        return
    whole = torch.empty(vocab_size, dtype=torch.float32)
    for row, seed, num_out in zip(rows, seeds, num_output_tokens, strict=True):
        whole.exponential_(generator=torch.Generator().manual_seed(seed + num_out))
        noise[row, :width].copy_(whole[col_offset : col_offset + width])
