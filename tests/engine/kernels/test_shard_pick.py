"""The pick over vocabulary shards: every rank's first launch over its own columns, then one
merge of all ranks' partials, picks what one pick over the whole vocabulary picks.

The ranks are simulated in one process: each shard's partials (the kernel's, and the torch
reference's that the CPU engine runs) are stacked in rank order as the all-gather leaves them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagekeeper_engine.kernels.pick_scratch import PickScratch
from pagekeeper_engine.kernels.sampling import chunk_partials, combine_partials
from pagekeeper_engine.model.shard import ShardPlan
from pagekeeper_engine.runner.pick import pick_tokens_ref
from pagekeeper_engine.runner.shard_pick import (
    VocabShard,
    chunk_partials_ref,
    combine_partials_ref,
)
from tests.engine.shapes import LLAMA_8B

BLOCK_V = 16


def shards_of(vocab_size: int, ranks: int) -> list[VocabShard]:
    config = dataclasses.replace(LLAMA_8B, vocab_size=vocab_size)
    return [VocabShard.of(ShardPlan.for_rank(config, r, ranks)) for r in range(ranks)]


def shard_columns(whole: torch.Tensor, shard: VocabShard, fill: float) -> torch.Tensor:
    """A rank's (N, width) columns: its vocabulary, then `fill` in the padding columns (the
    LM head's zero rows give 0 there; any value must be ignored)."""
    out = torch.full((whole.shape[0], shard.width), fill, dtype=whole.dtype, device=whole.device)
    out[:, : shard.valid] = whole[:, shard.start : shard.start + shard.valid]
    return out


def pick_over_shards(
    raw: torch.Tensor, noise: torch.Tensor | None, scale: float, ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, packed) from the kernels and from the torch references, over `ranks` shards."""
    num_rows, vocab_size = raw.shape
    shards = shards_of(vocab_size, ranks)
    scratch = PickScratch(num_rows, shards[0].width, raw.device, block_v=BLOCK_V, ranks=ranks)
    kernel_parts, ref_parts = [], []
    for shard in shards:
        logits = shard_columns(raw, shard, fill=1e4)  # padding that would win if it were read
        shard_noise = None if noise is None else shard_columns(noise, shard, fill=1.0)
        parts = chunk_partials(
            logits,
            logits,
            scale=scale,
            noise=shard_noise,
            scratch=scratch,
            valid=shard.valid,
            index_offset=shard.start,
            vocab_size=vocab_size,
        )
        kernel_parts.append(parts.clone())
        ref = torch.empty_like(parts)
        chunk_partials_ref(logits, scale, shard_noise, shard, BLOCK_V, out=ref)
        ref_parts.append(ref)
    kernel_gathered = scratch.gathered_view(num_rows)
    kernel_gathered.copy_(torch.stack(kernel_parts))
    ids, packed = (t.clone() for t in combine_partials(kernel_gathered, scratch, vocab_size))
    ref_ids = torch.empty(num_rows, dtype=torch.int64, device=raw.device)
    ref_packed = torch.empty(2, num_rows, dtype=torch.float64, device=raw.device)
    combine_partials_ref(torch.stack(ref_parts), vocab_size, ref_ids, ref_packed)
    for kernel, ref in zip(kernel_parts, ref_parts, strict=True):
        torch.testing.assert_close(kernel[:4], ref[:4], rtol=1e-5, atol=1e-5)
        assert torch.equal(kernel[4].view(torch.int32), ref[4].view(torch.int32))
    return ids, packed, ref_ids, ref_packed


@pytest.mark.parametrize("has_noise", [False, True])
@pytest.mark.parametrize(
    ("ranks", "vocab_size"),
    [(2, 97), (4, 97), (2, 64), (4, 5), (4, 200)],  # padding; whole chunks; an empty shard
)
def test_shards_pick_what_the_whole_vocabulary_picks(
    ranks: int, vocab_size: int, has_noise: bool, device: torch.device, generator: torch.Generator
) -> None:
    raw = 3 * torch.randn((6, vocab_size), generator=generator, device=device)
    noise = torch.empty_like(raw).exponential_(generator=generator) if has_noise else None
    scale = 1 / 0.7 if has_noise else 1.0

    ids, packed, ref_ids, ref_packed = pick_over_shards(raw, noise, scale, ranks)

    whole_ids, whole_packed = pick_tokens_ref(raw, raw, scale=scale, noise=noise)
    assert torch.equal(ids, whole_ids) and torch.equal(ref_ids, whole_ids)
    assert torch.equal(packed[0], whole_ids.double())
    torch.testing.assert_close(packed[1], whole_packed[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_packed, packed, rtol=1e-6, atol=1e-6)


def test_ties_across_shards_go_to_the_lowest_index(device: torch.device) -> None:
    vocab_size = 97
    raw = torch.zeros((4, vocab_size), device=device)
    raw[0, [90, 60, 49]] = 5.0  # rank 1's 49 wins over its own 60 and rank 1's 90
    raw[1, [48, 49]] = 5.0  # the last of rank 0, the first of rank 1
    raw[2, :] = float("-inf")  # nothing finite: index 0, as torch.argmax
    raw[3, vocab_size - 1] = 1.0  # the last column of the padded shard

    ids, _, ref_ids, _ = pick_over_shards(raw, None, 1.0, ranks=2)

    assert ids.tolist() == ref_ids.tolist() == [49, 48, 0, vocab_size - 1]
