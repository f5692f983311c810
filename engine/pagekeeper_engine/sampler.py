"""Picks the next token of each sampled row: greedy, or temperature with top-k and top-p.

Rows are processed together where their parameters allow: all greedy rows in one argmax, all
random rows through one temperature / top-k / top-p pass. Randomness comes from the exponential
race (argmax of p / E with E ~ Exp(1)), which samples exactly from p. A request with a seed gets
its own generator seeded with `seed + num_output_tokens`, so its tokens do not depend on what
else is in the batch or on preemption; the others share the engine's seeded generator.
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
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)


class Sampler:
    """Samples one token per row of a logits matrix, each row with its request's parameters."""

    def __init__(self, device: torch.device | str, seed: int, eos_token_ids: frozenset[int]):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids

    def __call__(
        self,
        logits: torch.Tensor,  # (N, V) fp32
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> SamplerOutput:
        """Sample and read the results back (one device-to-host transfer, one wait)."""
        packed = self.sample_packed(logits, params, num_output_tokens)
        token_col, logprob_col = packed.tolist()
        return SamplerOutput(token_ids=[int(t) for t in token_col], logprobs=logprob_col)

    def sample_packed(
        self,
        logits: torch.Tensor,  # (N, V) fp32
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """(2, N) float64 on the logits' device: the token ids, then their log-probabilities.
        Nothing waits for the device. Ids below 2**53 are exact in float64."""
        token_ids, logprobs = self.sample(logits, params, num_output_tokens)
        return torch.stack((token_ids.double(), logprobs.double()))

    def sample(
        self,
        logits: torch.Tensor,  # (N, V) fp32
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (N,) int64 and their log-probabilities (N,) fp32, left on the device."""
        num_rows = logits.shape[0]
        assert len(params) == num_rows == len(num_output_tokens), "one parameter set per row"
        raw_logits = logits
        logits = self._mask_early_stops(logits, params, num_output_tokens)
        is_greedy = [p.is_greedy for p in params]
        # Uniform batches (the common case) skip the row gathers and scatters.
        if all(is_greedy):
            token_ids = logits.argmax(dim=-1)
        elif not any(is_greedy):
            token_ids = self._sample_random(logits, params, num_output_tokens)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, g in enumerate(is_greedy) if g]
            random_rows = [i for i, g in enumerate(is_greedy) if not g]
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = logits[rows].argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample_random(
                logits[rows],
                [params[i] for i in random_rows],
                [num_output_tokens[i] for i in random_rows],
            )
        chosen = raw_logits.gather(1, token_ids[:, None]).squeeze(1)
        logprobs = chosen - raw_logits.logsumexp(dim=-1)
        return token_ids, logprobs

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

    def _sample_random(
        self,
        logits: torch.Tensor,  # (R, V)
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        device = logits.device
        temperatures = {p.temperature for p in params}
        if len(temperatures) == 1:  # one scalar: no host-to-device copy
            logits = logits / temperatures.pop()
        else:
            temperature = torch.tensor([p.temperature for p in params], device=device)
            logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):  # the same draws as below, without the scatter
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=device
            ).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                generator = torch.Generator(device=device).manual_seed(
                    p.seed + num_output_tokens[i]
                )
                noise[i].exponential_(generator=generator)
        # An exact 0 draw would make 0 / 0 = NaN for a masked token, and argmax prefers NaN.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
