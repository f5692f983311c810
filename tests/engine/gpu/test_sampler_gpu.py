"""The sampler on a GPU: a race with no seeded row has the pick draw its own noise (the draws
`exp_draws_ref` gives for the step's key), and a seeded row keeps its own generator's draws."""

from __future__ import annotations

import random

import pytest
import torch

from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.kernels.reference import exp_draws_ref
from pagekeeper_engine.runner.sampler import Sampler, pick_tokens_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SEED = 3
VOCAB = 5000


def logits(num_rows: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return (3 * torch.randn((num_rows, VOCAB), generator=gen, device="cuda")).bfloat16()


def test_an_unseeded_race_draws_in_the_pick_with_the_steps_key() -> None:
    sampler = Sampler("cuda", SEED, frozenset({2}))
    rows = logits(4)
    params = [SamplingParams(temperature=0.8)] * 4
    keys = random.Random(SEED)
    for _ in range(2):  # each step its own key
        token_ids, packed = sampler.sample(rows, params, [0] * 4)
        noise = exp_draws_ref(keys.getrandbits(63), 4, VOCAB).cuda()
        ref_ids, ref_packed = pick_tokens_ref(rows, rows, scale=1 / 0.8, noise=noise)
        assert torch.equal(token_ids, ref_ids)
        torch.testing.assert_close(packed[1], ref_packed[1], rtol=1e-5, atol=1e-5)


def test_a_seeded_row_picks_the_same_alone_or_beside_unseeded_rows() -> None:
    seeded = SamplingParams(temperature=0.8, seed=42)
    alone, _ = Sampler("cuda", SEED, frozenset({2})).sample(logits(1), [seeded], [5])
    rows = logits(1).expand(3, -1).contiguous()
    beside, _ = Sampler("cuda", SEED + 1, frozenset({2})).sample(
        rows, [SamplingParams(temperature=0.8), seeded, SamplingParams(temperature=0.8)], [0, 5, 0]
    )
    assert int(beside[1]) == int(alone[0])
