"""Sampling under tensor parallelism over each rank's shard of the vocabulary, so that for the
common batches no logits cross the ranks.

A batch whose rows pick alike (`uniform_race`: all greedy, or all random at one temperature),
with no top-k / top-p cut and no row held short of min_tokens, is picked here. Every rank runs
the pick's first launch over its own shard (`kernels.sampling.chunk_partials`, the chunks'
indices offset to the whole vocabulary's), the ranks all-gather those partials (PLANES x chunks
fp32 a row: 640 bytes at 32 chunks, against 128 kB of a 64k-entry shard's bf16 logits), and
every rank merges all of them (`combine_partials`) into the same tokens, so no broadcast of
the ids follows. Any other batch gets None: the launcher gathers the whole logits to rank 0,
which samples them (`Sampler`) and broadcasts the ids.

The race's Exp(1) draws: rows without a seed draw their shard's from a generator seeded per
rank (`seed * size + rank`), so the shards' draws are independent of each other; a row with a
seed draws its shard's columns as they are in its whole-vocabulary draws
(`pick.draw_seeded_noise`, as `Sampler` does over every column: on CUDA by its key at each
column's index, all seeded rows in one launch), so its tokens are the ones one GPU picks from
the same logits. On the CPU both launches are plain torch over the same partials
(`chunk_partials_ref`, `combine_partials_ref`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.kernels import NOISE_FLOOR
from pagekeeper_engine.kernels.pick_scratch import PLANES, PickScratch
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.shard import ShardPlan
from pagekeeper_engine.runner.logits_processing import uses_processors
from pagekeeper_engine.runner.pick import draw_seeded_noise
from pagekeeper_engine.runner.sampler import early_stop_ids, has_cut, uniform_race

_MAX, _SUM, _BEST, _RAW_AT_BEST, _INDEX = range(PLANES)


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns of the logits."""

    start: int  # its first column's index in the whole vocabulary
    valid: int  # columns that hold vocabulary entries (fewer on the last rank, or none)
    width: int  # columns every rank computes (the LM head's rows on a rank)
    vocab_size: int  # the whole vocabulary's

    @staticmethod
    def of(plan: ShardPlan) -> VocabShard:
        start, stop = plan.vocab_columns
        return VocabShard(start, stop - start, plan.vocab_shard, plan.config.vocab_size)


class ShardPicker:
    """One rank's sampling rows, allocated once for `max_rows` sequences: its shard's logits
    (where the LM head writes, graphs included), the race's draws, the pick's scratch with
    every rank's partials, and on rank 0 the rows the whole logits are gathered into for the
    batches it samples alone."""

    def __init__(
        self,
        max_rows: int,
        shard: VocabShard,
        tp: TensorParallelGroup,
        *,
        seed: int,
        eos_token_ids: frozenset[int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        assert tp.size > 1, "one GPU samples the whole logits (Sampler)"
        self.shard = shard
        self.tp = tp
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self.logits = torch.empty(max_rows, shard.width, dtype=dtype, device=device)
        self.noise = torch.empty(max_rows, shard.width, dtype=torch.float32, device=device)
        self.scratch = PickScratch(max_rows, shard.width, device, ranks=tp.size)
        self.gathered_logits = (
            torch.empty(tp.size, max_rows, shard.width, dtype=dtype, device=device)
            if tp.is_first
            else None
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed * tp.size + tp.rank)

    @property
    def nbytes(self) -> int:
        planes = [self.logits, self.noise]
        if self.gathered_logits is not None:
            planes.append(self.gathered_logits)
        return sum(t.nbytes for t in planes) + self.scratch.nbytes

    def pick(
        self,
        logits: torch.Tensor,  # (N, width): this rank's shard, as compute_logits wrote it
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], the same on every
        rank and left on the device; None for a batch that rank 0 samples from the whole
        logits. Every rank must call it with the same batch."""
        assert logits.shape == (len(params), self.shard.width), (
            f"logits {tuple(logits.shape)} for {len(params)} rows of {self.shard.width} columns"
        )
        race = uniform_race(params)
        rows = zip(params, num_output_tokens, strict=True)
        if (
            race is None
            or has_cut(params)
            or uses_processors(params)
            or any(early_stop_ids(p, n, self.eos_token_ids) for p, n in rows)
        ):
            return None
        noise = None if race.greedy else self._draw_noise(params, num_output_tokens)
        shard = self.shard
        if logits.is_cuda:
            # Imported on first CUDA use, as the sampler's pick is (`runner/sampler.py`).
            from pagekeeper_engine.kernels import sampling  # noqa: PLC0415

            parts = sampling.chunk_partials(
                logits,
                logits,
                scale=race.scale,
                noise=noise,
                scratch=self.scratch,
                valid=shard.valid,
                index_offset=shard.start,
                vocab_size=shard.vocab_size,
            )
        else:
            parts = self.scratch.views(len(params))[2]
            chunk_partials_ref(logits, race.scale, noise, shard, self.scratch.block_v, out=parts)
        gathered = self.scratch.gathered_view(len(params))
        self.tp.all_gather_(gathered, parts)
        if logits.is_cuda:
            return sampling.combine_partials(gathered, self.scratch, shard.vocab_size)
        token_ids, packed, _ = self.scratch.views(len(params))
        combine_partials_ref(gathered, shard.vocab_size, token_ids, packed)
        return token_ids, packed

    def _draw_noise(
        self, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> torch.Tensor:
        """(N, width) Exp(1) draws: the shard's columns of each seeded row's whole-vocabulary
        draws, the rank's own generator's elsewhere (padding columns are never read)."""
        noise = self.noise[: len(params)]
        noise.exponential_(generator=self.generator)
        seeded = [(row, p.seed) for row, p in enumerate(params) if p.seed is not None]
        if seeded:
            rows = [row for row, _ in seeded]
            seeds = [seed for _, seed in seeded]
            counts = [num_output_tokens[row] for row in rows]
            shard = self.shard
            draw_seeded_noise(
                noise, rows, seeds, counts, shard.start, shard.valid, shard.vocab_size
            )
        return noise


def shard_picker_for(
    model: CausalLM, max_rows: int, seed: int, eos_token_ids: frozenset[int]
) -> ShardPicker | None:
    """The picker over `model`'s vocabulary shard, in its dtype and on its device; None on one
    GPU, where the sampler reads the whole logits."""
    if model.tp.size == 1:
        return None
    weight = model.lm_head_weight
    return ShardPicker(
        max_rows,
        VocabShard.of(model.shard),
        model.tp,
        seed=seed,
        eos_token_ids=eos_token_ids,
        dtype=weight.dtype,
        device=weight.device,
    )


def chunk_partials_ref(
    logits: torch.Tensor,  # (N, width): scores and raw logits at once
    scale: float,
    noise: torch.Tensor | None,  # (N, width) fp32 Exp(1) draws
    shard: VocabShard,
    block_v: int,
    out: torch.Tensor,  # (PLANES, N, C) fp32, C = ceil(width / block_v)
) -> None:
    """`kernels.sampling.chunk_partials` in plain torch, in fp32, into `out`."""
    num_rows, num_chunks = logits.shape[0], out.shape[2]
    span = num_chunks * block_v
    lanes = torch.arange(span, device=logits.device)
    is_vocab = lanes < shard.valid
    raw = torch.full((num_rows, span), float("-inf"), device=logits.device)
    raw[:, : shard.valid] = logits[:, : shard.valid].float()
    race = raw * scale
    if noise is not None:
        race[:, : shard.valid] -= noise[:, : shard.valid].clamp(min=NOISE_FLOOR).log()
    raw_c, race_c = (
        raw.view(num_rows, num_chunks, block_v),
        race.view(num_rows, num_chunks, block_v),
    )
    raw_max = raw_c.amax(-1)
    shift = torch.where(raw_max == float("-inf"), 0.0, raw_max)
    best = race_c.amax(-1)
    hit = (race_c == best[..., None]) & is_vocab.view(num_chunks, block_v)
    lane = torch.where(hit, lanes[:block_v], block_v).amin(-1)  # block_v: no vocabulary lane
    has_lane = lane < block_v
    at_best = raw_c.gather(-1, lane.clamp(max=block_v - 1)[..., None]).squeeze(-1)
    chunk_start = torch.arange(num_chunks, device=logits.device) * block_v
    out[_MAX] = raw_max
    out[_SUM] = (raw_c - shift[..., None]).exp().sum(-1)
    out[_BEST] = best
    out[_RAW_AT_BEST] = torch.where(has_lane, at_best, float("-inf"))
    index = torch.where(has_lane, chunk_start + lane + shard.start, shard.vocab_size)
    out[_INDEX].view(torch.int32).copy_(index)


def combine_partials_ref(
    parts: torch.Tensor,  # (R, PLANES, N, C) fp32: every rank's partials, in rank order
    vocab_size: int,
    token_ids: torch.Tensor,  # (N,) int64 out
    packed: torch.Tensor,  # (2, N) float64 out
) -> None:
    """`kernels.sampling.combine_partials` in plain torch, into `token_ids` and `packed`."""
    ranks, _, num_rows, num_chunks = parts.shape
    planes = parts.permute(1, 2, 0, 3).reshape(PLANES, num_rows, ranks * num_chunks)
    chunk_max, chunk_sum, chunk_best, chunk_raw = (
        planes[_MAX],
        planes[_SUM],
        planes[_BEST],
        planes[_RAW_AT_BEST],
    )
    chunk_index = planes[_INDEX].contiguous().view(torch.int32).long()
    row_max = chunk_max.amax(-1)
    lse = row_max + (chunk_sum * (chunk_max - row_max[:, None]).exp()).sum(-1).log()
    best = chunk_best.amax(-1)
    token = torch.where(chunk_best == best[:, None], chunk_index, vocab_size - 1).amin(-1)
    token = token.clamp(max=vocab_size - 1)
    raw = torch.where(chunk_index == token[:, None], chunk_raw, float("-inf")).amax(-1)
    token_ids.copy_(token)
    packed[0].copy_(token.double())
    packed[1].copy_((raw - lse).double())
