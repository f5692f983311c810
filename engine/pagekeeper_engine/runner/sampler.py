"""Picks the next token of each sampled row: greedy, or temperature with top-k and top-p.

Every path ends in one pick: token = argmax(scores * scale - log E), logprob = raw[token] -
logsumexp(raw) under the model's unmodified logits; on CUDA that is two Triton launches
(`kernels/sampling.py`). The logits arrive in the model's dtype and the pick reads them so,
computing in fp32: only scores that a mask or a cut rewrites are copied, once, to fp32 rows.
Greedy rows pick their masked logits with no noise. Random rows race: argmax(l / T - log E) with
E ~ Exp(1) (the exponential race, or Gumbel-max trick) samples exactly from softmax(l / T) after
the top-k / top-p cut. A batch of greedy rows, or of random rows with one temperature (the
common cases), goes straight to the pick with scale 1 / T; a mixed batch builds its scores in
torch first. A request with a seed gets its own generator seeded with `seed +
num_output_tokens`, so its tokens do not depend on what else is in the batch or on preemption;
the others share the engine's seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.kernels import NOISE_FLOOR

if TYPE_CHECKING:
    from pagekeeper_engine.kernels.sampling import PickScratch


@dataclass(frozen=True)
class SamplerOutput:
    """One token and its log-probability (under the model's unmodified distribution) per row."""

    token_ids: list[int]
    logprobs: list[float]


# Logits the top-k / top-p cut sorts at once (whole rows, at least one): its scratch and the
# sort's own temporaries (about 75 MiB for 16 rows of a 152k vocabulary) scale with this, never
# with the batch, and stay below the smallest fragmentation buffer of the start-up budget.
CUT_CHUNK_ELEMENTS = 1 << 20


def cut_chunk_rows(max_rows: int, vocab_size: int) -> int:
    return max(1, min(max_rows, CUT_CHUNK_ELEMENTS // max(vocab_size, 1)))


class CutScratch:
    """The top-k / top-p cut's working rows: sorted values and ids, probabilities, mass."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.values = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.ids = torch.empty(num_rows, vocab_size, dtype=torch.int64, device=device)
        self.probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.mass = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.mask = torch.empty(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.ranks = torch.arange(vocab_size, device=device)
        self.row = torch.empty(num_rows, 1, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        planes = (self.values, self.ids, self.probs, self.mass, self.mask, self.ranks, self.row)
        return sum(t.nbytes for t in planes)


def apply_top_k_top_p(
    logits: torch.Tensor,  # (N, V) fp32
    top_k: torch.Tensor,  # (N,) int64; 0 or >= V means no cut
    top_p: torch.Tensor,  # (N,) fp32 in (0, 1]
    *,
    scale: float = 1.0,  # 1 / temperature: top-p measures the mass of softmax(logits * scale)
    out: torch.Tensor | None = None,  # (N, V) fp32, may be `logits` itself; default: a new one
    scratch: CutScratch | None = None,
) -> torch.Tensor:
    """Logits with everything outside each row's top-k, then top-p nucleus, set to -inf.

    Top-p keeps the smallest prefix of tokens (by descending probability, renormalised after the
    top-k cut) whose mass reaches top_p: a token stays when the mass strictly before it is below
    top_p, so the most likely token always stays. Rows are cut `scratch.num_rows` at a time in
    the scratch's rows.
    """
    num_rows, vocab_size = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if scratch is None:
        scratch = CutScratch(cut_chunk_rows(num_rows, vocab_size), vocab_size, logits.device)
    assert out.shape == logits.shape, f"out {tuple(out.shape)} != logits {tuple(logits.shape)}"
    top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    for start in range(0, num_rows, scratch.num_rows):
        end = min(start + scratch.num_rows, num_rows)
        n = end - start
        values, ids = scratch.values[:n], scratch.ids[:n]
        probs, mass, mask, row = (
            scratch.probs[:n],
            scratch.mass[:n],
            scratch.mask[:n],
            scratch.row[:n],
        )
        torch.sort(logits[start:end], dim=-1, descending=True, out=(values, ids))  # (n, V)
        torch.ge(scratch.ranks[None, :], top_k[start:end, None], out=mask)
        values.masked_fill_(mask, float("-inf"))
        # softmax(values * scale) in place: the row's maximum is its first value.
        torch.mul(values[:, :1], scale, out=row)
        torch.mul(values, scale, out=probs)
        probs.sub_(row).exp_()
        torch.sum(probs, dim=-1, keepdim=True, out=row)
        probs.div_(row)
        torch.cumsum(probs, dim=-1, out=mass)
        mass.sub_(probs)  # the mass strictly before each token
        torch.ge(mass, top_p[start:end, None], out=mask)
        values.masked_fill_(mask, float("-inf"))
        out[start:end].fill_(float("-inf")).scatter_(-1, ids, values)
    return out


def pick_tokens_ref(
    scores: torch.Tensor,  # (N, V) fp32 or raw's dtype
    raw: torch.Tensor,  # (N, V) fp32, bf16 or fp16: the model's unmodified logits
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,  # (N, V) fp32 Exp(1) draws, each >= 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sampling.pick_tokens` in plain torch, in fp32: the CPU path and the kernel's
    reference."""
    race = scores.float() * scale
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
    scratch: PickScratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], left on the device (in
    `scratch` where given)."""
    if not raw.is_cuda:
        return pick_tokens_ref(scores, raw, scale=scale, noise=noise)
    # Imported on first CUDA use: a kernel module fixes interpreted or native mode
    # (`TRITON_INTERPRET`) when it is imported, and the CPU path needs no triton.
    from pagekeeper_engine.kernels import sampling  # noqa: PLC0415

    return sampling.pick_tokens(scores, raw, scale=scale, noise=noise, scratch=scratch)


def _has_cut(params: Sequence[SamplingParams]) -> bool:
    return any(p.top_k > 0 or p.top_p < 1.0 for p in params)


def _cut_top_k_top_p(
    scores: torch.Tensor,  # (N, V) fp32, cut in place
    params: Sequence[SamplingParams],
    scale: float,
    scratch: CutScratch,
) -> None:
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=scores.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=scores.device)
    apply_top_k_top_p(scores, top_k, top_p, scale=scale, out=scores, scratch=scratch)


class SamplerBuffers:
    """The rows a step's sampling works in, allocated once for `max_rows` sequences: the logits
    in the model's dtype (`CausalLM.compute_logits` writes them), the Exp(1) draws, the fp32
    scores the pick reads where a mask or a cut changes them, a mixed batch's random rows, and
    the cut's scratch, and on CUDA the pick's outputs and partials. A step works in their
    leading rows, so sampling allocates nothing of the batch's size from the caching allocator.
    The pick's ids of a step stay valid until the next step's pick is enqueued."""

    def __init__(
        self, max_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.max_rows = max_rows
        self.logits = torch.empty(max_rows, vocab_size, dtype=dtype, device=device)
        self.noise = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=device)
        self.scores = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=device)
        self.rows = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=device)
        self.cut = CutScratch(cut_chunk_rows(max_rows, vocab_size), vocab_size, device)
        self.pick: PickScratch | None = None
        if torch.device(device).type == "cuda":
            from pagekeeper_engine.kernels.sampling import PickScratch  # noqa: PLC0415

            self.pick = PickScratch(max_rows, vocab_size, device)

    @property
    def nbytes(self) -> int:
        planes = (self.logits, self.noise, self.scores, self.rows)
        pick = 0 if self.pick is None else self.pick.nbytes
        return sum(t.nbytes for t in planes) + self.cut.nbytes + pick


class Sampler:
    """Samples one token per row of a logits matrix, each row with its request's parameters.

    Every path works in `buffers` (sized for the batch on the fly where none are given, as on
    the CPU); the logits themselves are never written, since the log-probabilities read them.
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
        logits: torch.Tensor,  # (N, V) fp32, bf16 or fp16
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> SamplerOutput:
        """Sample and read the results back (one device-to-host transfer, one wait)."""
        _, packed = self.sample(logits, params, num_output_tokens)
        token_col, logprob_col = packed.tolist()
        return SamplerOutput(token_ids=[int(t) for t in token_col], logprobs=logprob_col)

    def _buffers_for(self, logits: torch.Tensor) -> SamplerBuffers:
        buffers = self.buffers
        if buffers is not None and logits.shape[0] <= buffers.max_rows:
            return buffers
        return SamplerBuffers(logits.shape[0], logits.shape[1], logits.dtype, logits.device)

    def sample(
        self,
        logits: torch.Tensor,  # (N, V) fp32, bf16 or fp16
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], on the logits'
        device; nothing waits for it. Ids below 2**53 are exact in float64."""
        assert len(params) == logits.shape[0] == len(num_output_tokens), "one parameter set per row"
        buffers = self._buffers_for(logits)
        masked = self._mask_early_stops(logits, params, num_output_tokens, buffers)
        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            return pick_tokens(masked, logits, scratch=buffers.pick)
        temperatures = {p.temperature for p in params}
        if not any(is_greedy) and len(temperatures) == 1:
            scale = 1.0 / temperatures.pop()
            scores = masked
            if _has_cut(params):
                scores = buffers.scores[: len(params)]
                if masked is not scores:
                    scores.copy_(masked)
                _cut_top_k_top_p(scores, params, scale, buffers.cut)
            noise = self._draw_noise(buffers.noise, params, num_output_tokens)
            return pick_tokens(scores, logits, scale=scale, noise=noise, scratch=buffers.pick)
        scores = self._mixed_scores(masked, params, num_output_tokens, buffers)
        return pick_tokens(scores, logits, scratch=buffers.pick)

    def _mask_early_stops(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        buffers: SamplerBuffers,
    ) -> torch.Tensor:
        """Rows still short of min_tokens cannot pick a token that would stop them: the logits,
        or their fp32 copy in `buffers.scores` with those tokens at -inf."""
        masked = logits
        for row, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
            if num_out >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if not stop_ids:
                continue
            if masked is logits:
                masked = buffers.scores[: logits.shape[0]]
                masked.copy_(logits)
            masked[row, sorted(stop_ids)] = float("-inf")
        return masked

    def _mixed_scores(
        self,
        masked: torch.Tensor,  # (N, V): the logits, or their masked copy in buffers.scores
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        buffers: SamplerBuffers,
    ) -> torch.Tensor:
        """(N, V) fp32 scores whose plain argmax is each row's pick: greedy rows keep their
        logits, random rows get the race's l / T - log E (the fused path's arithmetic, in
        torch)."""
        num_rows = masked.shape[0]
        scores = buffers.scores[:num_rows]
        if masked is not scores:
            scores.copy_(masked)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        random_params = [params[i] for i in random_rows]
        device = masked.device
        rows = torch.tensor(random_rows, device=device)
        inv_temperature = torch.tensor([1.0 / p.temperature for p in random_params], device=device)
        scaled = buffers.rows[: len(random_rows)]  # (R, V)
        torch.index_select(scores, 0, rows, out=scaled)
        scaled.mul_(inv_temperature[:, None])
        noise = self._draw_noise(
            buffers.noise, random_params, [num_output_tokens[i] for i in random_rows]
        )
        if _has_cut(random_params):
            _cut_top_k_top_p(scaled, random_params, 1.0, buffers.cut)
        scaled.sub_(noise.clamp_(min=NOISE_FLOOR).log_())  # the draws are spent here
        return scores.index_copy_(0, rows, scaled)

    def _draw_noise(
        self,
        plane: torch.Tensor,  # (>= R, V) where the draws go
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """(R, V) Exp(1) draws in the leading rows of `plane`, each >= 0: seeded rows from their
        own generators. An exact 0 is possible: readers take max(E, NOISE_FLOOR)."""
        noise = plane[: len(params)]
        device = noise.device
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):  # the same draws as below, without the scatter
            noise.exponential_(generator=self.generator)
        elif unseeded:
            # The draws of one (U, V) tensor, made in the leading rows and moved down to their
            # rows last first: row j goes to unseeded[j] >= j, never onto a row still to move.
            noise[: len(unseeded)].exponential_(generator=self.generator)
            for j in reversed(range(len(unseeded))):
                if unseeded[j] != j:
                    noise[unseeded[j]].copy_(noise[j])
        for i, p in enumerate(params):
            if p.seed is not None:
                generator = torch.Generator(device=device).manual_seed(
                    p.seed + num_output_tokens[i]
                )
                noise[i].exponential_(generator=generator)
        return noise
