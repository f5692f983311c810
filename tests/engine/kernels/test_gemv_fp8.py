"""The batch-1 GEMV over FP8 (e4m3) weights with a scale per row, against the torch reference
over the dequantized weights, at small irregular shapes (Triton's interpreter on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.nn import functional

from benchmarks.layer_tiles import SWEEP
from pagekeeper_engine.kernels.gemv import (
    CANDIDATES,
    Epilogue,
    GemvConfig,
    RowNorm,
    gemv,
    programs,
)
from pagekeeper_engine.kernels.reference import gemv_fp8_ref
from pagekeeper_engine.model.fp8 import FP8_DTYPE, quantize_rows
from tests.engine.kernels.paged_cases import random_tensor

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# The kernel's sums are fp32 and its result is rounded once to the dtype: one rounding step of
# the output apart from the fp32 reference (the scale is applied after the sum, not before).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMALL = GemvConfig(block_n=4, block_k=32, num_warps=1, num_stages=1)
SHAPES = [(4, 32), (13, 96), (12, 100), (1, 7), (37, 129)]


def fp8_weight(
    n: int, k: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    # Rows of very different magnitudes: a wrong row's scale changes the result by far more
    # than the tolerance.
    weight = random_tensor((n, k), torch.float32, device, generator)
    weight *= torch.logspace(-2, 2, n, device=device)[:, None]
    return quantize_rows(weight)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_the_dequantized_linear(
    dtype: torch.dtype,
    n: int,
    k: int,
    bias: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    x = random_tensor((3, k), dtype, device, generator)[1:2]
    weight, scale = fp8_weight(n, k, device, generator)
    b = random_tensor((n,), dtype, device, generator) if bias else None

    out = gemv(x, weight, b, config=SMALL, weight_scale=scale)

    assert out.shape == (1, n) and out.dtype == dtype
    assert_close(out, gemv_fp8_ref(x, weight, scale, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(13, 96), (37, 129)])
def test_fp8_gemv_with_the_norm_and_the_residual_add(
    dtype: torch.dtype, n: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    x = 3.0 * random_tensor((1, k), dtype, device, generator)
    norm_weight = random_tensor((k,), dtype, device, generator)
    weight, scale = fp8_weight(n, k, device, generator)
    residual = random_tensor((1, n), dtype, device, generator)
    before = residual.clone()
    parts = torch.full((programs(n, SMALL),), -1.0, device=device)

    gemv(
        x,
        weight,
        out=residual,
        config=SMALL,
        norm=RowNorm(norm_weight, 1e-6),
        epilogue=Epilogue.ADD,
        sum_squares_out=parts,
        weight_scale=scale,
    )

    x32 = x.float()
    normed = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    expected = (gemv_fp8_ref(normed, weight, scale).to(dtype) + before).float()
    assert_close(residual, expected, dtype)
    squares = residual.float().pow(2)[0]
    expected_parts = torch.stack([cols.sum() for cols in squares.split(SMALL.block_n)])
    torch.testing.assert_close(parts, expected_parts, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(12, 96), (13, 100)])
def test_fp8_gemv_swiglu_scales_the_gate_and_up_rows_apart(
    dtype: torch.dtype, n: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    x = random_tensor((1, k), dtype, device, generator)
    weight, scale = fp8_weight(2 * n, k, device, generator)  # (2I, K): gate rows, then up rows

    out = gemv(x, weight, config=SMALL, epilogue=Epilogue.SWIGLU, weight_scale=scale)

    gate_up = gemv_fp8_ref(x, weight, scale).to(dtype)
    gate, up = gate_up.float().split(n, dim=-1)
    expected = (functional.silu(gate).to(dtype).float() * up).to(dtype).float()
    assert out.shape == (1, n)
    assert_close(out, expected, dtype)


# The shipped tiles, then the others `benchmarks/layer_tiles.py` times in the fused layer.
TILES = list(dict.fromkeys([*CANDIDATES, *SWEEP]))


@pytest.mark.parametrize("config", TILES, ids=str)
def test_fp8_tiles_in_the_fused_layers_normed_swiglu(
    config: GemvConfig, device: torch.device, generator: torch.Generator
) -> None:
    # Each tile over e4m3 weights, more than one program and K tile, in the fused layer's
    # heaviest form: the norm in the prologue and SwiGLU in the epilogue.
    n, k = 2 * config.block_n + 3, 2 * config.block_k
    x = random_tensor((1, k), torch.float32, device, generator)
    # Norm weights of 1/k: gates far inside silu's range whatever the rows' scales.
    norm_weight = random_tensor((k,), torch.float32, device, generator) / k
    weight, scale = fp8_weight(2 * n, k, device, generator)

    out = gemv(
        x,
        weight,
        config=config,
        norm=RowNorm(norm_weight, 1e-6),
        epilogue=Epilogue.SWIGLU,
        weight_scale=scale,
    )

    normed = norm_weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = gemv_fp8_ref(normed, weight, scale).split(n, dim=-1)
    assert_close(out, functional.silu(gate) * up, torch.float32)


def test_quantized_rows_round_trip_within_e4m3_precision(
    device: torch.device, generator: torch.Generator
) -> None:
    weight = random_tensor((9, 40), torch.float32, device, generator) * 50.0
    weight[3] = 0.0  # an all-zero row quantizes to zeros, not NaN
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == FP8_DTYPE and scale.shape == (9,)
    assert torch.equal(quantized[3].float(), torch.zeros(40, device=device))
    # Each row's largest value lands on e4m3's largest, 448; the rest within half a step of
    # three mantissa bits (2^-4 relative) of the row's values.
    assert torch.equal(
        quantized.float().abs().amax(dim=1)[[0, 1, 2, 4]], torch.full((4,), 448.0, device=device)
    )
    restored = quantized.float() * scale[:, None]
    assert ((restored - weight).abs() <= weight.abs() / 16 + 1e-30).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight": lambda d: torch.zeros(4, 8, device=d)}, "goes with an torch.float8_e4m3fn"),
        ({"weight_scale": lambda d: torch.ones(5, device=d)}, r"shape \(5,\) != \(4,\)"),
        (
            {"weight_scale": lambda d: torch.ones(4, device=d, dtype=torch.float16)},
            "weight_scale must be float32",
        ),
        ({"weight_scale": lambda d: torch.ones(8, device=d)[::2]}, "must be contiguous"),
    ],
)
def test_fp8_gemv_rejects_bad_scales(
    change: dict[str, Callable[[torch.device], torch.Tensor]],
    message: str,
    device: torch.device,
) -> None:
    args = {
        "weight": lambda d: torch.zeros(4, 8, device=d).to(FP8_DTYPE),
        "weight_scale": lambda d: torch.ones(4, device=d),
    }
    args.update(change)
    x = torch.zeros(1, 8, device=device)
    weight, scale = args["weight"](device), args["weight_scale"](device)
    with pytest.raises(AssertionError, match=message):
        gemv(x, weight, weight_scale=scale, config=SMALL)
    with pytest.raises(AssertionError, match=r"weight is torch\.float8_e4m3fn"):
        gemv(x, torch.zeros(4, 8, device=device).to(FP8_DTYPE), config=SMALL)
