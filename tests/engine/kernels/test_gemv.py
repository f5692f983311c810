from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from pagekeeper_engine.kernels.gemv import CANDIDATES, GemvConfig, gemv
from tests.engine.kernels.paged_cases import random_tensor

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# Both sums are fp32; the result is rounded once to the dtype, so they differ by about one
# rounding step of the output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMALL = GemvConfig(block_n=4, block_k=32, num_warps=1, num_stages=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k"),
    # Even and ragged in each dimension against the 4 x 32 tile: one tile, several, a tail.
    [(4, 32), (12, 96), (13, 96), (12, 100), (1, 7), (37, 129)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(
    dtype: torch.dtype,
    n: int,
    k: int,
    bias: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    x = random_tensor((3, k), dtype, device, generator)[1:2]  # a row of a larger buffer
    weight = random_tensor((n, k), dtype, device, generator)
    b = random_tensor((n,), dtype, device, generator) if bias else None

    out = gemv(x, weight, b, config=SMALL)

    expected = functional.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.shape == (1, n) and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())


@pytest.mark.parametrize("config", CANDIDATES)
def test_gemv_candidates_at_a_projection_like_shape(
    config: GemvConfig, device: torch.device, generator: torch.Generator
) -> None:
    # The tiles the engine runs, over more than one program and more than one K tile.
    x = random_tensor((1, 2 * config.block_k), torch.float32, device, generator)
    weight = random_tensor(
        (3 * config.block_n, 2 * config.block_k), torch.float32, device, generator
    )
    # fp32 sums over 2 x block_k terms in another order: a few units in the last place.
    torch.testing.assert_close(gemv(x, weight, config=config), x @ weight.t(), rtol=1e-5, atol=2e-4)


def test_gemv_into_a_given_row(device: torch.device, generator: torch.Generator) -> None:
    x = random_tensor((1, 64), torch.float32, device, generator)
    weight = random_tensor((10, 64), torch.float32, device, generator)
    buffer = torch.full((3, 10), -7.0, device=device)
    out = gemv(x, weight, out=buffer[1:2], config=SMALL)
    assert out.data_ptr() == buffer[1].data_ptr()
    torch.testing.assert_close(buffer[1:2], x @ weight.t())
    assert (buffer[[0, 2]] == -7.0).all()  # the other rows are untouched


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            lambda d: (torch.zeros(2, 8, device=d), torch.zeros(4, 8, device=d)),
            "must be \\(1, K\\)",
        ),
        (lambda d: (torch.zeros(1, 8, device=d), torch.zeros(4, 6, device=d)), "K=8"),
        (lambda d: (torch.zeros(1, 8, device=d), torch.zeros(8, 4, device=d).t()), "contiguous"),
        (
            lambda d: (
                torch.zeros(1, 8, device=d),
                torch.zeros(4, 8, device=d, dtype=torch.float16),
            ),
            "weight is torch.float16",
        ),
    ],
)
def test_gemv_rejects_bad_inputs(args: object, message: str, device: torch.device) -> None:
    assert callable(args)
    with pytest.raises(AssertionError, match=message):
        gemv(*args(device))


def test_gemv_refuses_an_output_over_its_input(device: torch.device) -> None:
    buffer = torch.zeros(1, 16, device=device)
    with pytest.raises(AssertionError, match="overlaps x"):
        gemv(buffer, torch.zeros(16, 16, device=device), out=buffer)
