"""Per-token FP8 quantization of activations: the Triton kernel against `model.fp8`'s torch
code, at irregular widths over strided rows.

Triton's CPU interpreter narrows to e4m3 without the carry into the exponent (7.9 becomes 4,
not 8), so there the test feeds values that land exactly on e4m3's grid, which any narrowing
keeps: the rows, strides, masks and scales are checked, not the rounding. On a GPU the
hardware's narrowing is checked bit for bit against torch's on random values.
"""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels import is_interpreter
from pagekeeper_engine.kernels.fp8_quant import quantize_tokens
from pagekeeper_engine.model import fp8
from tests.engine.kernels.paged_cases import random_tensor

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
SHAPES = [(1, 7), (3, 64), (5, 1030), (2, 2500)]


def strided(x: torch.Tensor) -> torch.Tensor:
    """x's values in a row-strided view of a larger buffer."""
    m, k = x.shape
    buffer = torch.zeros((m + 1, k + 3), dtype=x.dtype, device=x.device)
    view = buffer[1:, 2 : k + 2]
    view.copy_(x)
    return view


def assert_quantized_as_the_reference(x: torch.Tensor) -> None:
    quantized, scales = quantize_tokens(x)
    expected_q, expected_scales = fp8.quantize_tokens(x)
    assert quantized.shape == x.shape and scales.shape == (x.shape[0], 1)
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    assert torch.equal(quantized.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_values_on_the_e4m3_grid(
    dtype: torch.dtype, m: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    # Random e4m3 values (every bit pattern but NaN), each row holding +-448 so that its scale
    # is the power of two it is multiplied by: x / scale is the grid value again.
    bits = torch.randint(0, 256, (m, k), generator=generator, device=device, dtype=torch.uint8)
    grid = bits.view(torch.float8_e4m3fn).float()
    grid = torch.where(grid.isnan(), 0.0, grid)
    grid[:, -1] = torch.where(torch.arange(m, device=device) % 2 == 0, 448.0, -448.0)
    powers = 2.0 ** torch.arange(-6, -6 + m, device=device, dtype=torch.float32)
    x = strided((grid * powers[:, None]).to(dtype))  # exact in every dtype tested
    assert_quantized_as_the_reference(x)


# A GPU test: the interpreter's e4m3 narrowing drops carries, so only the hardware's rounding
# can be compared with torch's.
@pytest.mark.gpu
@pytest.mark.skipif(
    is_interpreter() or not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the interpreter's e4m3 narrowing drops carries)",
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_rounding_matches_torch_bit_for_bit(
    dtype: torch.dtype, m: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    x = random_tensor((m, k), dtype, device, generator)
    x = x * torch.logspace(-3, 3, m, device=device, dtype=dtype)[:, None]
    assert_quantized_as_the_reference(strided(x))


def test_an_all_zero_row_takes_the_floor_scale(device: torch.device) -> None:
    quantized, scales = quantize_tokens(torch.zeros(2, 40, device=device))
    assert scales.flatten().tolist() == [pytest.approx(fp8.MIN_SCALE)] * 2
    assert not quantized.float().any()


def test_the_launcher_names_a_bad_argument(device: torch.device) -> None:
    with pytest.raises(AssertionError, match=r"x must be \(M, K\)"):
        quantize_tokens(torch.zeros(8, device=device))
    with pytest.raises(AssertionError, match="contiguous in its last dimension"):
        quantize_tokens(torch.zeros(8, 4, device=device).t())
