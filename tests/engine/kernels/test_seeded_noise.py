"""The seeded rows' draws (`kernels/seeded_noise.py`): the kernel draws what its reference
draws, a shard's columns are the whole vocabulary's at those indices, the draws are Exp(1), and
a seeded request's key depends on its seed and length alone (`runner/pick.seeded_key`)."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.reference import seeded_noise_ref
from pagekeeper_engine.kernels.seeded_noise import BLOCK, seeded_noise
from pagekeeper_engine.runner.pick import seeded_key


@pytest.mark.parametrize(("width", "col_offset"), [(1, 0), (37, 0), (BLOCK + 5, 0), (300, 2**33)])
def test_the_kernel_draws_what_its_reference_draws(
    width: int, col_offset: int, device: torch.device
) -> None:
    keys = [seeded_key(7, 0), 2**62 + 5, 12345]
    rows = [3, 0, 1]
    noise = torch.full((4, width + 3), -1.0, device=device)
    seeded_noise(noise, rows, keys, col_offset, width)
    want = torch.full((4, width + 3), -1.0)
    seeded_noise_ref(want, rows, keys, col_offset, width)
    torch.testing.assert_close(noise.cpu(), want, rtol=1e-6, atol=0)
    assert bool((noise[2] == -1.0).all()) and bool((noise[:, width:] == -1.0).all())  # untouched


def test_a_shards_draws_are_the_whole_vocabularys_at_its_columns(device: torch.device) -> None:
    vocab, keys = 1000, [seeded_key(-3, 9), seeded_key(11, 0)]
    whole = torch.empty(2, vocab, device=device)
    seeded_noise(whole, [0, 1], keys, 0, vocab)
    for start, valid in ((0, 334), (334, 334), (668, 332)):
        shard = torch.empty(2, 334, device=device)
        seeded_noise(shard, [0, 1], keys, start, valid)
        assert torch.equal(shard[:, :valid], whole[:, start : start + valid])


def test_the_draws_are_exponential_with_mean_one() -> None:
    noise = torch.empty(4, 50_000)
    seeded_noise_ref(noise, [0, 1, 2, 3], [seeded_key(s, 1) for s in range(4)], 0, 50_000)
    assert bool((noise >= 0).all()) and bool(torch.isfinite(noise).all())
    assert abs(noise.mean().item() - 1.0) < 0.01  # 200,000 draws: sd of the mean 0.0022
    assert abs((noise > 1.0).float().mean().item() - torch.exp(torch.tensor(-1.0)).item()) < 0.01


def test_seeded_keys_differ_by_seed_and_by_length_and_stay_in_int64() -> None:
    keys = {seeded_key(seed, n) for seed in (-1, 0, 1, 2**40, 5) for n in range(50)}
    assert len(keys) == 5 * 50 and all(0 <= k < 2**63 for k in keys)
    assert seeded_key(5, 3) == seeded_key(5, 3)
    assert seeded_key(-1, 3) == seeded_key(2**64 - 1, 3)  # a seed is read as 64 bits


def test_the_launcher_refuses_what_it_cannot_draw(device: torch.device) -> None:
    noise = torch.empty(2, 8, device=device)
    for call, message in [
        (lambda: seeded_noise(noise, [2], [1], 0, 8), "outside"),
        (lambda: seeded_noise(noise, [0], [1, 2], 0, 8), "a key for each"),
        (lambda: seeded_noise(noise, [0], [2**63], 0, 8), "int64"),
        (lambda: seeded_noise(noise, [0], [1], 0, 9), "hold"),
        (lambda: seeded_noise(noise.double(), [0], [1], 0, 8), "float64"),
    ]:
        with pytest.raises(AssertionError, match=message):
            call()
