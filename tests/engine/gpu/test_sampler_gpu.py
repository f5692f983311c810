"""The sampler on a GPU: a batch of one temperature and no seeded row samples by inverting
each row's CDF at the uniform its step's key gives (`uniforms_ref`), and a seeded row races over
its own key's draws (`seeded_noise_ref`), beside unseeded rows or alone."""

from __future__ import annotations

import random

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.kernels.reference import inverse_cdf_ref, seeded_noise_ref, uniforms_ref
from pagekeeper_engine.runner.pick import pick_tokens_ref, seeded_key
from pagekeeper_engine.runner.sampler import Sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SEED = 3
VOCAB = 5000


def logits(num_rows: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return (3 * torch.randn((num_rows, VOCAB), generator=gen, device="cuda")).bfloat16()


def test_an_unseeded_batch_inverts_the_cdf_at_its_steps_key() -> None:
    sampler = Sampler("cuda", SEED, frozenset({2}))
    rows = logits(4)
    params = [SamplingParams(temperature=0.8)] * 4
    keys = random.Random(SEED)
    for _ in range(2):  # each step its own key
        token_ids, packed = sampler.sample(rows, params, [0] * 4)
        uniforms = uniforms_ref(keys.getrandbits(63), 4).cuda()
        ref_ids, ref_packed = inverse_cdf_ref(rows, rows, scale=1 / 0.8, uniforms=uniforms)
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


def test_a_seeded_row_races_over_its_keys_draws() -> None:
    rows = logits(3)
    params = [SamplingParams(temperature=0.8, seed=s) for s in (42, -7, 2**40)]
    token_ids, packed = Sampler("cuda", SEED, frozenset({2})).sample(rows, params, [5, 0, 9])
    noise = torch.empty(3, VOCAB)
    keys = [seeded_key(42, 5), seeded_key(-7, 0), seeded_key(2**40, 9)]
    seeded_noise_ref(noise, [0, 1, 2], keys, 0, VOCAB)
    ref_ids, ref_packed = pick_tokens_ref(rows.cpu(), rows.cpu(), scale=1 / 0.8, noise=noise)
    assert torch.equal(token_ids.cpu(), ref_ids)
    torch.testing.assert_close(packed[1].cpu(), ref_packed[1], rtol=1e-5, atol=1e-5)
