from __future__ import annotations

import math

import pytest
import torch

from pagekeeper_engine.kernels.sampling import BLOCK_V, pick_tokens
from pagekeeper_engine.runner.sampler import pick_tokens_ref

# Many chunks at small vocabularies: 63 at V = 1000, as 128,256 has at BLOCK_V.
SMALL_BLOCK_V = 16


def random_logits(
    num_rows: int, vocab_size: int, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return 3 * torch.randn((num_rows, vocab_size), generator=gen, device=device)


def check_against_ref(
    scores: torch.Tensor,
    raw: torch.Tensor,
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
) -> torch.Tensor:
    token_ids, packed = pick_tokens(scores, raw, scale=scale, noise=noise, block_v=block_v)
    ref_ids, ref_packed = pick_tokens_ref(scores, raw, scale=scale, noise=noise)
    assert token_ids.dtype == torch.int64 and packed.dtype == torch.float64
    assert packed.shape == (2, raw.shape[0])
    assert torch.equal(token_ids, ref_ids)
    assert torch.equal(packed[0], token_ids.double())
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=1e-5, atol=1e-5)
    return token_ids


@pytest.mark.parametrize("has_noise", [False, True])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "block_v"),
    [
        (1, 1, BLOCK_V),
        (3, 37, BLOCK_V),
        (5, BLOCK_V + 5, BLOCK_V),
        (1, 3 * BLOCK_V - 1, BLOCK_V),
        (3, 1000, SMALL_BLOCK_V),
    ],
)
def test_pick_matches_torch(
    num_rows: int,
    vocab_size: int,
    block_v: int,
    has_noise: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    raw = random_logits(num_rows, vocab_size, device, generator)
    # Masked tokens, as min_tokens and top-k / top-p leave them; one row entirely.
    is_masked = torch.rand(raw.shape, generator=generator, device=device) < 0.3
    scores = raw.masked_fill(is_masked, float("-inf"))
    scores[-1, : vocab_size // 2] = float("-inf")
    noise = None
    if has_noise:
        noise = torch.empty_like(raw).exponential_(generator=generator)
    check_against_ref(scores, raw, scale=1 / 0.7, noise=noise, block_v=block_v)


def test_pick_over_strided_rows(device: torch.device, generator: torch.Generator) -> None:
    raw = random_logits(8, 300, device, generator)[::2]
    noise = torch.empty((8, 300), device=device).exponential_(generator=generator)[1::2]
    check_against_ref(raw, raw, scale=2.0, noise=noise, block_v=64)


@pytest.mark.parametrize("block_v", [SMALL_BLOCK_V, BLOCK_V])
def test_ties_go_to_the_lowest_index(block_v: int, device: torch.device) -> None:
    vocab_size = 3 * block_v - 1
    scores = torch.zeros((5, vocab_size), device=device)
    scores[0, [2 * block_v + 1, block_v + 3, 7]] = 5.0  # across chunks: 7 wins
    scores[1, [block_v - 1, block_v]] = 5.0  # the last of chunk 0, the first of chunk 1
    scores[2, :] = float("-inf")
    scores[2, vocab_size - 1] = -1e30  # -inf never wins over a finite score
    scores[3, :] = float("-inf")  # nothing finite: index 0, as torch.argmax
    # Row 4, all zeros: index 0.

    token_ids = check_against_ref(scores, torch.zeros_like(scores), block_v=block_v)

    assert token_ids.tolist() == [7, block_v - 1, vocab_size - 1, 0, 0]


def test_noise_can_overturn_the_argmax(device: torch.device) -> None:
    scores = torch.tensor([[2.0, 1.0, 0.0]], device=device)
    noise = torch.tensor([[1.0, math.exp(-2.0), 1.0]], device=device)  # -log: 0, 2, 0

    token_ids, packed = pick_tokens(scores, torch.zeros_like(scores), scale=1.0, noise=noise)

    assert token_ids.tolist() == [1]
    assert packed.tolist() == [[1.0], [pytest.approx(-math.log(3.0), abs=1e-6)]]
    # At scale 2 the first token's lead (4) outruns the noise (3).
    assert pick_tokens(scores, scores, scale=2.0, noise=noise)[0].tolist() == [0]


def test_pick_of_no_rows(device: torch.device) -> None:
    token_ids, packed = pick_tokens(*[torch.empty((0, 50), device=device)] * 2)
    assert token_ids.shape == (0,) and packed.shape == (2, 0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda d: {"raw": torch.zeros(8, device=d)}, "raw must be"),
        (lambda d: dict.fromkeys(("raw", "scores"), torch.zeros((2, 0), device=d)), "empty"),
        (lambda d: {"scores": torch.zeros((2, 7), device=d)}, "scores shape"),
        (lambda d: {"scores": torch.zeros((2, 8), dtype=torch.float16, device=d)}, "float32"),
        (lambda d: {"scores": torch.zeros((8, 2), device=d).t()}, "contiguous"),
        (lambda d: {"noise": torch.ones((3, 8), device=d)}, "noise shape"),
        (lambda d: {"scale": 0.0}, "scale"),
        (lambda d: {"scale": math.inf}, "scale"),
        (lambda d: {"block_v": 48}, "block_v"),
    ],
)
def test_pick_rejects_bad_inputs(bad: object, message: str, device: torch.device) -> None:
    assert callable(bad)
    args = {"scores": torch.zeros((2, 8), device=device), "raw": torch.zeros((2, 8), device=device)}
    with pytest.raises(AssertionError, match=message):
        pick_tokens(**{**args, **bad(device)})
