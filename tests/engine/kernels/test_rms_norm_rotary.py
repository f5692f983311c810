from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.reference import rms_norm_ref, rotary_ref
from pagekeeper_engine.kernels.rms_norm import rms_norm
from pagekeeper_engine.kernels.rotary import apply_rotary_
from tests.engine.kernels.paged_cases import random_tensor

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# One rounding step of the dtype: the kernels and torch may sum in different orders.
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 1000])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_matches_reference(
    dtype: torch.dtype,
    dim: int,
    has_residual: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    # x as a strided view (every other row), as slices of a larger activation buffer are.
    x = random_tensor((14, dim), dtype, device, generator)[::2]
    weight = random_tensor((dim,), dtype, device, generator)
    residual = random_tensor((7, dim), dtype, device, generator) if has_residual else None

    out, summed = rms_norm(x, weight, 1e-6, residual)

    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, rtol=RTOL[dtype], atol=RTOL[dtype])
    if residual is None:
        assert summed is None
    else:
        assert summed is not None and ref_summed is not None
        assert torch.equal(summed, ref_summed)  # one rounding of the same exact sum


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_over_the_residual_stream(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    # The decoder's use: hidden becomes norm(hidden + residual), residual becomes the sum.
    hidden = random_tensor((9, 96), dtype, device, generator)
    residual = random_tensor((9, 96), dtype, device, generator)
    weight = random_tensor((96,), dtype, device, generator)
    ref_out, ref_summed = rms_norm_ref(hidden, weight, 1e-6, residual)

    out, summed = rms_norm(hidden, weight, 1e-6, residual, out=hidden, summed=residual)

    assert out.data_ptr() == hidden.data_ptr() and summed is residual
    assert ref_summed is not None and torch.equal(residual, ref_summed)
    torch.testing.assert_close(hidden, ref_out, rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_in_place_inside_a_fused_projection(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    # The q/k norm: each head's vector of q, a strided (T, heads, D) view of the qkv buffer.
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    qkv = random_tensor(
        (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, device, generator
    )
    before = qkv.clone()
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    weight = random_tensor((head_dim,), dtype, device, generator)
    ref_q, _ = rms_norm_ref(q.clone(), weight, 1e-6)

    rms_norm(q, weight, 1e-6, out=q)

    torch.testing.assert_close(q, ref_q, rtol=RTOL[dtype], atol=RTOL[dtype])
    assert torch.equal(qkv[:, num_heads * head_dim :], before[:, num_heads * head_dim :])


def test_rms_norm_of_a_constant_row_is_the_weight(device: torch.device) -> None:
    x = torch.full((1, 32), 3.0, device=device)
    weight = torch.arange(32, dtype=torch.float32, device=device)
    out, _ = rms_norm(x, weight, 0.0)
    torch.testing.assert_close(out[0], weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (6, 2, 128)])
def test_rotary_matches_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    num_tokens, max_position = 9, 100
    angles = torch.rand((max_position, head_dim // 2), generator=generator, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator, device=device)
    # q and k as views of one fused qkv projection output.
    qkv = random_tensor(
        (num_tokens, num_heads + 2 * num_kv_heads, head_dim), dtype, device, generator
    )
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    ref_q = rotary_ref(q, positions, cos, sin)
    ref_k = rotary_ref(k, positions, cos, sin)

    apply_rotary_(q, k, positions, cos, sin)

    torch.testing.assert_close(q, ref_q, rtol=RTOL[dtype], atol=RTOL[dtype])
    torch.testing.assert_close(k, ref_k, rtol=RTOL[dtype], atol=RTOL[dtype])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before), "v must not change"


def test_rotary_at_position_zero_is_identity(device: torch.device) -> None:
    q = torch.arange(2 * 3 * 32, dtype=torch.float32, device=device).view(2, 3, 32)
    k = q[:, :1].clone()
    expected_q, expected_k = q.clone(), k.clone()
    angles = torch.ones((4, 16), device=device)
    angles[0] = 0.0
    apply_rotary_(
        q, k, torch.zeros(2, dtype=torch.int64, device=device), angles.cos(), angles.sin()
    )
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("positions_dtype", "positions must be"),
        ("table_dtype", "cos must be float32"),
        ("head_dim", "k shape"),
    ],
)
def test_rotary_rejects_bad_inputs(change: str, message: str, device: torch.device) -> None:
    q = torch.zeros((2, 4, 32), device=device)
    k = torch.zeros((2, 1, 32), device=device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    cos = torch.zeros((8, 16), device=device)
    if change == "positions_dtype":
        positions = positions.int()
    elif change == "table_dtype":
        cos = cos.double()
    elif change == "head_dim":
        k = torch.zeros((2, 1, 64), device=device)
    with pytest.raises(AssertionError, match=message):
        apply_rotary_(q, k, positions, cos, cos.clone().float())
