"""Picks the next token of each sampled row: greedy, or temperature with top-k and top-p.

Every path ends in one pick, logprob = raw[token] - logsumexp(raw) under the model's unmodified
logits; on CUDA that is one Triton launch (`kernels/sampling.py`). The logits arrive in the
model's dtype and the pick reads them so, computing in fp32: only scores that a mask or a cut
rewrites are copied, once, to fp32 rows. Greedy rows pick the argmax of their masked logits.
Random rows sample softmax(l / T) after the top-k / top-p cut, in one of two exact ways. A batch
of one temperature with no seeded row (the common case) goes straight to the pick with scale 1 /
T, and on CUDA with a key: the pick inverts each row's softmax CDF at one uniform draw it makes
from the key (the sampler's host generator, seeded with the engine's seed, gives one key a
step). Any other batch, and any batch on the CPU, races: argmax(l / T - log E) with E ~ Exp(1)
(the exponential race, or Gumbel-max trick), a mixed batch building its race scores in torch
first. A request with a seed draws by its seed and its number of output tokens (on CUDA a
Philox key made of them, `pick.seeded_key`, every seeded row of a step in one launch; on the
CPU a generator seeded with their sum), so its tokens do not depend on what else is in the
batch, on preemption, or on tensor parallelism; the other rows' draws come from the engine's
device generator.

A batch where some row asks for a logit bias, a penalty, min-p or top alternatives first has
its scores rewritten (`logits_processing`), and its top alternatives are appended to the packed
results; a batch where none does takes exactly the path above, at the cost of one check. A batch
whose only processing is the schemas' masks, and whose rows pick alike without a cut, hands the
filled bitmask to the pick, which reads its scores through it (no copy of the logits, no pass
that writes the mask into them); any other structured batch has its masks written into its
scores first.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.kernels import NOISE_FLOOR
from pagekeeper_engine.kernels.pick_scratch import PickScratch
from pagekeeper_engine.runner.logits_processing import (
    StepHistory,
    masks_alone,
    process_scores,
    top_logprobs,
    uses_processors,
)
from pagekeeper_engine.runner.pick import draw_seeded_noise, pick_tokens
from pagekeeper_engine.runner.structured_output import GrammarMasks, PendingMasks
from pagekeeper_engine.runner.top_k_top_p import CutScratch, cut_chunk_rows, cut_top_k_top_p


@dataclass(frozen=True)
class SamplerOutput:
    """One token and its log-probability (under the model's unmodified distribution) per row."""

    token_ids: list[int]
    logprobs: list[float]


def has_cut(params: Sequence[SamplingParams]) -> bool:
    return any(p.top_k > 0 or p.top_p < 1.0 for p in params)


def early_stop_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: frozenset[int]
) -> frozenset[int]:
    """The tokens a row may not pick yet: those that would stop it short of min_tokens."""
    if num_output_tokens >= params.min_tokens:
        return frozenset()
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


@dataclass(frozen=True)
class UniformRace:
    """A batch whose rows all pick alike: greedy (no noise), or racing at one scale 1 / T."""

    greedy: bool
    scale: float


def uniform_race(params: Sequence[SamplingParams]) -> UniformRace | None:
    """How every row of the batch picks, when they all pick alike; None for a mixed batch."""
    if all(p.is_greedy for p in params):
        return UniformRace(greedy=True, scale=1.0)
    temperatures = {p.temperature for p in params}
    if any(p.is_greedy for p in params) or len(temperatures) != 1:
        return None
    return UniformRace(greedy=False, scale=1.0 / temperatures.pop())


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
        self.pick_keys = random.Random(seed)  # a key a step for the CUDA pick's uniform draws
        self.eos_token_ids = eos_token_ids
        self.buffers = buffers
        self.grammar: GrammarMasks | None = None  # rank 0's, for structured requests

    def __call__(
        self,
        logits: torch.Tensor,  # (N, V) fp32, bf16 or fp16
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        history: StepHistory | None = None,
    ) -> SamplerOutput:
        """Sample and read the results back (one device-to-host transfer, one wait)."""
        _, packed = self.sample(logits, params, num_output_tokens, history)
        token_col, logprob_col = packed[:2].tolist()
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
        history: StepHistory | None = None,  # the rows' tokens so far, for the penalties
        masks: PendingMasks | None = None,  # the schemas' masks, started at the launch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (N,) int64 and (2 + 2K, N) float64 [ids; log-probabilities; K rows of the
        top alternatives' ids; K of their log-probabilities] (K = 0 unless a row asks for
        them), on the logits' device; nothing waits for it. Ids below 2**53 are exact in
        float64."""
        assert len(params) == logits.shape[0] == len(num_output_tokens), "one parameter set per row"
        buffers = self._buffers_for(logits)
        masked = self._mask_early_stops(logits, params, num_output_tokens, buffers)
        race = uniform_race(params)
        if not uses_processors(params):
            return self._pick(logits, masked, params, num_output_tokens, buffers, race)
        if masks_alone(params) and race is not None and not has_cut(params):
            # the pick reads the schemas' bitmask as it reads the scores: no fp32 copy of the
            # logits, no pass that writes -inf into them first
            assert self.grammar is not None, (
                "a structured request reached a sampler without grammars"
            )
            if masks is None:
                assert history is not None, "the grammars read the rows' tokens so far"
                masks = self.grammar.start(params, history)
            bitmask = self.grammar.bitmask(masks)
            return self._pick(logits, masked, params, num_output_tokens, buffers, race, bitmask)
        scores = buffers.scores[: len(params)]
        if masked is not scores:
            scores.copy_(masked)
        process_scores(
            scores, params, history, buffers.noise, buffers.rows, buffers.cut, self.grammar, masks
        )
        token_ids, packed = self._pick(logits, scores, params, num_output_tokens, buffers, race)
        num_top = min(max(p.top_logprobs for p in params), logits.shape[1])
        if num_top == 0:
            return token_ids, packed
        # after the pick: its scores and rows are spent, so the row plane is free again
        top_ids, top_values = top_logprobs(logits, num_top, buffers.rows)
        return token_ids, torch.cat((packed, top_ids.T.double(), top_values.T.double()))

    def _pick(
        self,
        logits: torch.Tensor,
        masked: torch.Tensor,  # the logits, or their rewritten copy in buffers.scores
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        buffers: SamplerBuffers,
        race: UniformRace | None,  # `uniform_race(params)`
        bitmask: torch.Tensor | None = None,  # the schemas', for rows alike and uncut
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if race is not None and race.greedy:
            return pick_tokens(masked, logits, scratch=buffers.pick, bitmask=bitmask)
        if race is not None:
            scale = race.scale
            scores = masked
            if has_cut(params):
                assert bitmask is None, "a cut reads the masked scores: mask them first"
                scores = buffers.scores[: len(params)]
                if masked is not scores:
                    scores.copy_(masked)
                cut_top_k_top_p(scores, params, scale, buffers.cut)
            if buffers.pick is not None and all(p.seed is None for p in params):
                key = self.pick_keys.getrandbits(63)  # one uniform draw a row, in the pick
                return pick_tokens(
                    scores,
                    logits,
                    scale=scale,
                    sample_key=key,
                    scratch=buffers.pick,
                    bitmask=bitmask,
                )
            noise = self._draw_noise(buffers.noise, params, num_output_tokens)
            return pick_tokens(
                scores, logits, scale=scale, noise=noise, scratch=buffers.pick, bitmask=bitmask
            )
        assert bitmask is None, "a mixed batch builds its race scores: mask them first"
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
            stop_ids = early_stop_ids(p, num_out, self.eos_token_ids)
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
        if has_cut(random_params):
            cut_top_k_top_p(scaled, random_params, 1.0, buffers.cut)
        scaled.sub_(noise.clamp_(min=NOISE_FLOOR).log_())  # the draws are spent here
        return scores.index_copy_(0, rows, scaled)

    def _draw_noise(
        self,
        plane: torch.Tensor,  # (>= R, V) where the draws go
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> torch.Tensor:
        """(R, V) Exp(1) draws in the leading rows of `plane`, each >= 0: seeded rows by their
        own seeds (`pick.draw_seeded_noise`: on CUDA all of them in one launch). An exact 0 is
        possible: readers take max(E, NOISE_FLOOR)."""
        noise = plane[: len(params)]
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
        seeded = [(i, p.seed) for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            rows = [i for i, _ in seeded]
            seeds = [seed for _, seed in seeded]
            counts = [num_output_tokens[i] for i in rows]
            width = noise.shape[1]
            draw_seeded_noise(noise, rows, seeds, counts, 0, width, width)
        return noise
