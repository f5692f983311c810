from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from pagekeeper_engine.kernels.swiglu import BLOCK, swiglu
from tests.engine.kernels.paged_cases import random_tensor

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# One rounding step of the dtype: exp may differ in its last bits between Triton and torch.
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", DTYPES)
# Widths below, at and across the kernel's column block (one and two column programs).
@pytest.mark.parametrize("intermediate", [48, BLOCK, BLOCK + 40])
def test_swiglu_matches_torch(
    dtype: torch.dtype, intermediate: int, device: torch.device, generator: torch.Generator
) -> None:
    # A strided view of rows, as a slice of a larger projection output would be.
    gate_up = random_tensor((10, 2 * intermediate), dtype, device, generator)[::2] * 3
    gate, up = gate_up.split(intermediate, dim=-1)

    out = swiglu(gate_up)

    assert out.shape == (5, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, functional.silu(gate) * up, rtol=RTOL[dtype], atol=RTOL[dtype])


def test_swiglu_exact_values(device: torch.device) -> None:
    # silu(0) = 0, silu(x) -> x for large x, silu(-x) -> 0: exact in fp32 at these points.
    gate = torch.tensor([[0.0, 40.0, -40.0, 0.0]], device=device)
    up = torch.tensor([[5.0, 2.0, 7.0, -1.0]], device=device)
    out = swiglu(torch.cat((gate, up), dim=1))
    torch.testing.assert_close(out, torch.tensor([[0.0, 80.0, 0.0, 0.0]], device=device))


def test_swiglu_of_no_rows(device: torch.device) -> None:
    assert swiglu(torch.empty((0, 64), device=device)).shape == (0, 32)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda d: torch.zeros((2, 7), device=d), "is odd"),
        (lambda d: torch.zeros((4, 8), device=d).t(), "contiguous"),
        (lambda d: torch.zeros((2, 8), dtype=torch.int32, device=d), "not supported"),
    ],
)
def test_swiglu_rejects_bad_inputs(bad: object, message: str, device: torch.device) -> None:
    assert callable(bad)
    with pytest.raises(AssertionError, match=message):
        swiglu(bad(device))


def test_swiglu_into_a_given_buffer(device: torch.device, generator: torch.Generator) -> None:
    gate_up = random_tensor((6, 2 * 40), torch.float32, device, generator)
    gate, up = gate_up.split(40, dim=-1)
    buffer = torch.full((8, 40), -7.0, device=device)

    out = swiglu(gate_up, out=buffer[:6])

    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:6], functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert torch.equal(buffer[6:], torch.full((2, 40), -7.0, device=device)), "rows past 6 kept"
