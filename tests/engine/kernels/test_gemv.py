from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from pagekeeper_engine.kernels.gemv import (
    CANDIDATES,
    Epilogue,
    GemvConfig,
    RowNorm,
    gemv,
    programs,
)
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


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm arithmetic (`model/layers.py`): fp32 statistics, the normed row
    rounded to the dtype before the weight multiply."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(12, 96), (13, 100), (37, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_with_the_input_norm_matches_norm_then_linear(
    dtype: torch.dtype,
    n: int,
    k: int,
    bias: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    residual = 3.0 * random_tensor((1, k), dtype, device, generator)
    before = residual.clone()
    norm_weight = random_tensor((k,), dtype, device, generator)
    weight = random_tensor((n, k), dtype, device, generator)
    b = random_tensor((n,), dtype, device, generator) if bias else None

    out = gemv(residual, weight, b, config=SMALL, norm=RowNorm(norm_weight, 1e-6))

    normed = _rms_norm_ref(residual, norm_weight, 1e-6)
    expected = functional.linear(normed.float(), weight.float(), None if b is None else b.float())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())
    assert torch.equal(residual, before)  # x is only read


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(12, 96), (13, 100)])
def test_gemv_adding_into_the_residual(
    dtype: torch.dtype, n: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    x = random_tensor((1, k), dtype, device, generator)
    weight = random_tensor((n, k), dtype, device, generator)
    residual = random_tensor((1, n), dtype, device, generator)
    before = residual.clone()

    out = gemv(x, weight, out=residual, config=SMALL, epilogue=Epilogue.ADD)

    assert out.data_ptr() == residual.data_ptr()
    # y is rounded to the dtype first, then added: what a projection then a residual add give.
    expected = (functional.linear(x.float(), weight.float()).to(dtype) + before).float()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        residual.float(), expected, rtol=tol, atol=tol * expected.abs().max()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(12, 96), (13, 100), (37, 129)])
def test_gemv_adding_into_the_residual_sums_its_squares(
    dtype: torch.dtype, n: int, k: int, device: torch.device, generator: torch.Generator
) -> None:
    x = random_tensor((1, k), dtype, device, generator)
    weight = random_tensor((n, k), dtype, device, generator)
    residual = random_tensor((1, n), dtype, device, generator)
    parts = torch.full((programs(n, SMALL),), -1.0, device=device)  # every entry overwritten

    gemv(x, weight, out=residual, config=SMALL, epilogue=Epilogue.ADD, sum_squares_out=parts)

    # Each program's entry: the squares of the values it stored (rounded to the dtype), its
    # block_n columns of the new residual.
    squares = residual.float().pow(2)[0]
    expected = torch.stack([cols.sum() for cols in squares.split(SMALL.block_n)])
    torch.testing.assert_close(parts, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(12, 96), (37, 129)])
@pytest.mark.parametrize("epilogue", [Epilogue.STORE, Epilogue.SWIGLU])
def test_gemv_norm_with_a_given_statistic_equals_its_own_pass(
    dtype: torch.dtype,
    n: int,
    k: int,
    epilogue: Epilogue,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    residual = 3.0 * random_tensor((1, k), dtype, device, generator)
    norm_weight = random_tensor((k,), dtype, device, generator)
    weight = random_tensor((2 * n, k), dtype, device, generator)
    # Partial sums in three uneven parts, as a residual-adding GEMV would leave them.
    statistic = torch.stack([part.sum() for part in residual.float().pow(2)[0].tensor_split(3)])

    norm = RowNorm(norm_weight, 1e-6)
    passed = gemv(residual, weight, config=SMALL, norm=norm, epilogue=epilogue)
    given = gemv(
        residual,
        weight,
        config=SMALL,
        norm=RowNorm(norm_weight, 1e-6, statistic),
        epilogue=epilogue,
    )

    # The two sums of squares differ only in their fp32 order: at most a rounding step apart.
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(given.float(), passed.float(), rtol=tol, atol=tol)
    # The statistic is read, not recomputed: a wrong one gives another result.
    scaled = gemv(
        residual,
        weight,
        config=SMALL,
        norm=RowNorm(norm_weight, 1e-6, 4.0 * statistic),
        epilogue=epilogue,
    )
    assert not torch.allclose(scaled.float(), passed.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("i", "k"), [(12, 96), (13, 100), (37, 129)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_gemv_swiglu_matches_gate_up_then_swiglu(
    dtype: torch.dtype,
    i: int,
    k: int,
    with_norm: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    x = random_tensor((1, k), dtype, device, generator)
    weight = random_tensor((2 * i, k), dtype, device, generator)
    norm = RowNorm(random_tensor((k,), dtype, device, generator), 1e-5) if with_norm else None

    out = gemv(x, weight, config=SMALL, norm=norm, epilogue=Epilogue.SWIGLU)

    source = x if norm is None else _rms_norm_ref(x, norm.weight, norm.eps)
    gate, up = functional.linear(source.float(), weight.float()).to(dtype).split(i, dim=-1)
    expected = (functional.silu(gate.float()).to(dtype).float() * up.float()).to(dtype).float()
    assert out.shape == (1, i) and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epilogue": Epilogue.ADD}, "adds into"),
        ({"epilogue": Epilogue.SWIGLU, "shape": (7, 16)}, "2I rows"),
        ({"norm_shape": (8,)}, "norm weight shape"),
        ({"sum_squares_out": 1}, "goes with Epilogue.ADD"),
        ({"sum_squares_out": 1, "epilogue": Epilogue.ADD, "half": True}, "float32"),
        # 8 columns are one program of the default tile
        ({"sum_squares_out": 3, "epilogue": Epilogue.ADD}, "3 entries for 1 programs"),
    ],
)
def test_gemv_rejects_bad_fusions(
    kwargs: dict[str, object], message: str, device: torch.device
) -> None:
    shape = kwargs.pop("shape", (8, 16))
    norm_shape = kwargs.pop("norm_shape", None)
    half = kwargs.pop("half", False)
    assert isinstance(shape, tuple)
    entries = kwargs.get("sum_squares_out")
    if isinstance(entries, int):
        dtype = torch.float16 if half else torch.float32
        kwargs["sum_squares_out"] = torch.zeros(entries, dtype=dtype, device=device)
        if kwargs.get("epilogue") == Epilogue.ADD:
            kwargs["out"] = torch.zeros(1, shape[0], device=device)
    norm = None
    if isinstance(norm_shape, tuple):
        norm = RowNorm(torch.ones(norm_shape, device=device), 1e-6)
    with pytest.raises(AssertionError, match=message):
        gemv(
            torch.zeros(1, 16, device=device),
            torch.zeros(shape, device=device),
            norm=norm,
            **kwargs,
        )  # type: ignore[arg-type]
