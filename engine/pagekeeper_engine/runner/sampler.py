"""Picks the next token of each sampled row: greedy, or temperature with top-k and top-p.

Every path ends in one pick: token = argmax(scores * scale - log E), logprob = raw[token] -
logsumexp(raw) under the model's unmodified logits; on CUDA that is two Triton launches
(`kernels/sampling.py`). Greedy rows pick their masked logits with no noise. Random rows race:
argmax(l / T - log E) with E ~ Exp(1) (the exponential race, or Gumbel-max trick) samples exactly
from softmax(l / T) after the top-k / top-p cut. A batch of greedy rows, or of random rows with
one temperature (the common cases), goes straight to the pick with scale 1 / T; a mixed batch
builds its scores in torch first. A request with a seed gets its own generator seeded with
`seed + num_output_tokens`, so its tokens do not depend on what else is in the batch or on
preemption; the others share the engine's seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekeeper_engine.core.sampling import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    """One token and its log-probability (under the model's unmodified distribution) per row."""

    token_ids: list[int]
    logprobs: list[float]


def apply_top_k_top_p(
    logits: torch.Tensor,  # (N, V) fp32
    top_k: torch.Tensor,  # (N,) int64; 0 or >= V means no cut
    top_p: torch.Tensor,  # (N,) fp32 in (0, 1]
    *,
    scale: float = 1.0,  # 1 / temperature: top-p measures the mass of softmax(logits * scale)
) -> torch.Tensor:
    """Logits with everything outside each row's top-k, then top-p nucleus, set to -inf.

    Top-p keeps the smallest prefix of tokens (by descending probability, renormalised after the
    top-k cut) whose mass reaches top_p: a token stays when the mass strictly before it is below
    top_p, so the most likely token always stays.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (N, V)
    ranks = torch.arange(vocab_size, device=logits.device)
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = (sorted_logits * scale).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)


def pick_tokens_ref(
    scores: torch.Tensor,  # (N, V) fp32
    raw: torch.Tensor,  # (N, V) fp32: the model's unmodified logits
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,  # (N, V) fp32 Exp(1) draws
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sampling.pick_tokens` in plain torch: the CPU path and the kernel's reference."""
    race = scores * scale
    if noise is not None:
        race = race - noise.log()
    token_ids = race.argmax(dim=-1)  # ties: the lowest index
    logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - raw.logsumexp(dim=-1)
    return token_ids, torch.stack((token_ids.double(), logprobs.double()))


def pick_tokens(
    scores: torch.Tensor,
    raw: torch.Tensor,
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], left on the device."""
    if not raw.is_cuda:
        return pick_tokens_ref(scores, raw, scale=scale, noise=noise)
    # Imported on first CUDA use: a kernel module fixes interpreted or native mode
    # (`TRITON_INTERPRET`) when it is imported, and the CPU path needs no triton.
    from pagekeeper_engine.kernels import sampling  # noqa: PLC0415

    return sampling.pick_tokens(scores, raw, scale=scale, noise=noise)


def _cut_top_k_top_p(
    logits: torch.Tensor, params: Sequence[SamplingParams], scale: float
) -> torch.Tensor:
    if not any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        return logits
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)
    return apply_top_k_top_p(logits, top_k, top_p, scale=scale)


class SamplerBuffers:
    """The rows a step's logits and noise live in, allocated once for `max_rows` sequences:
    the logits in the model's dtype and in fp32, and the Exp(1) draws. A step works in their
    leading rows, so sampling leaves nothing of the batch's size in the caching allocator."""

    def __init__(
        self, max_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.max_rows = max_rows
        self.logits_low = torch.empty(max_rows, vocab_size, dtype=dtype, device=device)
        self.logits = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=device)
        self.noise = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.logits_low.nbytes + self.logits.nbytes + self.noise.nbytes

    @property
    def logits_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits_low, self.logits


class Sampler:
    """Samples one token per row of a logits matrix, each row with its request's parameters.

    With `buffers`, the common paths (greedy, or one temperature without top-k/top-p) draw
    their noise into them instead of allocating it.
    """

    def __init__(
        self,
        device: torch.device | str,
        seed: int,
        eos_token_ids: frozenset[int],
        buffers: SamplerBuffers | None = None,
    ):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids
        self.buffers = buffers

    def __call__(
        self,
        logits: torch.Tensor,  # (N, V) fp32
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> SamplerOutput:
        """Sample and read the results back (one device-to-host transfer, one wait)."""
        _, packed = self.sample(logits, params, num_output_tokens)
        token_col, logprob_col = packed.tolist()
        return SamplerOutput(token_ids=[int(t) for t in token_col], logprobs=logprob_col)

    def sample(
        self,
        logits: torch.Tensor,  # (N, V) fp32
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], on the logits'
        device; nothing waits for it. Ids below 2**53 are exact in float64."""
        assert len(params) == logits.shape[0] == len(num_output_tokens), "one parameter set per row"
        masked = self._mask_early_stops(logits, params, num_output_tokens)
        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            return pick_tokens(masked, logits)
        temperatures = {p.temperature for p in params}
        if not any(is_greedy) and len(temperatures) == 1:
            scale = 1.0 / temperatures.pop()
            scores = _cut_top_k_top_p(masked, params, scale)
            noise = self._draw_noise(masked, params, num_output_tokens)
            return pick_tokens(scores, logits, scale=scale, noise=noise)
        return pick_tokens(self._mixed_scores(masked, params, num_output_tokens), logits)

    def _mask_early_stops(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """Rows still short of min_tokens cannot pick a token that would stop them."""
        masked = logits
        for row, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
            if num_out >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if not stop_ids:
                continue
            if masked is logits:
                masked = logits.clone()
            masked[row, sorted(stop_ids)] = float("-inf")
        return masked

    def _mixed_scores(
        self,
        logits: torch.Tensor,  # (N, V), masked
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """(N, V) scores whose plain argmax is each row's pick: greedy rows keep their logits,
        random rows get the race's l / T - log E (the fused path's arithmetic, in torch)."""
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        random_params = [params[i] for i in random_rows]
        rows = torch.tensor(random_rows, device=logits.device)
        inv_temperature = torch.tensor(
            [1.0 / p.temperature for p in random_params], device=logits.device
        )
        scaled = logits[rows] * inv_temperature[:, None]  # (R, V)
        noise = self._draw_noise(scaled, random_params, [num_output_tokens[i] for i in random_rows])
        race = _cut_top_k_top_p(scaled, random_params, 1.0) - noise.log()
        return logits.index_copy(0, rows, race)

    def _draw_noise(
        self,
        like: torch.Tensor,  # (R, V): the random rows
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """(R, V) Exp(1) draws, each > 0: seeded rows from their own generators."""
        device = like.device
        buffers = self.buffers
        noise = (
            buffers.noise[: like.shape[0]]
            if buffers is not None and like.shape[0] <= buffers.max_rows
            else torch.empty_like(like)
        )
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):  # the same draws as below, without the scatter
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), like.shape[1], device=device).exponential_(
                generator=self.generator
            )
        for i, p in enumerate(params):
            if p.seed is not None:
                generator = torch.Generator(device=device).manual_seed(
                    p.seed + num_output_tokens[i]
                )
                noise[i].exponential_(generator=generator)
        # An exact 0 draw would make -log E = +inf, and +inf + -inf = NaN for a masked token.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
