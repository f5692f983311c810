from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.kv_write import rotate_and_write_kv, write_kv
from pagekeeper_engine.kernels.reference import (
    quantize_fp8_ref,
    rms_norm_ref,
    rotary_ref,
    write_kv_ref,
)
from tests.engine.kernels.paged_cases import needs_fp8_gpu, random_tensor

HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
FP8 = torch.float8_e4m3fn


def _qkv_views(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as strided views of one fused qkv projection output, as the model produces."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random_tensor((num_tokens, width), dtype, device, gen)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    return (
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [
        (8, 1, 64, torch.float32),
        (16, 2, 128, torch.float32),
        (32, 8, 64, torch.float32),
        (16, 3, 64, torch.float16),
        *[(16, 8, 128, dtype) for dtype in HALF_DTYPES],
    ],
)
def test_write_kv_matches_reference(
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    num_blocks, num_tokens = 7, 13
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = random_tensor(shape, dtype, device, generator)
    v_cache = random_tensor(shape, dtype, device, generator)
    k, v = _qkv_views(
        num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype, device, generator
    )
    slots = torch.randperm(num_blocks * block_size, generator=generator, device=device)[:num_tokens]
    slots[[3, 10]] = -1  # padding rows store nothing
    before = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, expected_k, expected_v, slots)

    write_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    # The reference is itself checked: exactly the 11 real slots changed, and they hold k.
    flat_k = k_cache.view(-1, num_kv_heads * head_dim)
    changed_slots = (flat_k != before.view_as(flat_k)).any(dim=1).nonzero().flatten()
    real_slots = slots[slots >= 0]
    assert torch.equal(changed_slots, real_slots.sort().values)
    assert torch.equal(flat_k[real_slots], k[slots >= 0].reshape(11, -1))


def test_write_kv_with_no_tokens_leaves_cache_alone(
    device: torch.device, generator: torch.Generator
) -> None:
    k_cache = random_tensor((2, 8, 1, 32), torch.float32, device, generator)
    v_cache = k_cache.clone()
    before = k_cache.clone()
    empty = torch.empty((0, 1, 32), device=device)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("slot_dtype", "slot_mapping must be int64"),
        ("block_size", "block size 12 is not one of"),
        ("heads", "k has 2 heads, the cache 1"),
        ("dtype", "k is torch.float16 but the cache is torch.float32"),
        ("head_dim", "head_dim 48 must be a power of 2"),
    ],
)
def test_write_kv_rejects_bad_inputs(change: str, message: str, device: torch.device) -> None:
    block_size, num_kv_heads, head_dim = 8, 1, 32
    k = torch.ones((3, num_kv_heads, head_dim), device=device)
    slots = torch.arange(3, device=device)
    if change == "slot_dtype":
        slots = slots.to(torch.int32)
    elif change == "block_size":
        block_size = 12
    elif change == "heads":
        k = torch.ones((3, 2, head_dim), device=device)
    elif change == "dtype":
        k = k.half()
    elif change == "head_dim":
        head_dim = 48
    cache = torch.zeros((2, block_size, num_kv_heads, head_dim), device=device)
    with pytest.raises(AssertionError, match=message):
        write_kv(k, k, cache, cache.clone(), slots)


# (num_heads, num_kv_heads, head_dim, block_size, dtype): odd head counts, small head_dim.
ROTARY_CASES = [
    (6, 3, 64, 16, torch.float32),
    (4, 1, 32, 8, torch.float32),
    (5, 5, 64, 32, torch.float16),
    *[(32, 8, 128, 16, dtype) for dtype in HALF_DTYPES],
]
ROTARY_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype"), ROTARY_CASES
)
def test_rotate_and_write_kv_matches_rotary_then_write(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    num_blocks, num_tokens, max_position = 5, 11, 300
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = random_tensor(shape, dtype, device, generator)
    v_cache = random_tensor(shape, dtype, device, generator)
    angles = torch.rand((max_position, head_dim // 2), generator=generator, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator, device=device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random_tensor((num_tokens, width), dtype, device, generator)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator, device=device)[:num_tokens]
    slots[[0, 7]] = -1  # padding rows: q still rotated, nothing stored
    k_before, v_before, k_cache_before = k.clone(), v.clone(), k_cache.clone()
    expected_q = rotary_ref(q, positions, cos, sin)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_ref(rotary_ref(k, positions, cos, sin), v, expected_k_cache, expected_v_cache, slots)

    rotate_and_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)

    tol = ROTARY_RTOL[dtype]
    torch.testing.assert_close(q, expected_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k_cache, expected_k_cache, rtol=tol, atol=tol)
    assert torch.equal(v_cache, expected_v_cache), "v is stored unchanged"
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k and v are only read"
    # Every slot but the 9 real ones keeps its bytes exactly.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert int(untouched.sum()) == num_blocks * block_size - 9
    flat = k_cache.view(num_blocks * block_size, -1)
    assert torch.equal(flat[untouched], k_cache_before.view_as(flat)[untouched])


def test_rotate_and_write_kv_at_position_zero_stores_k_unchanged(device: torch.device) -> None:
    k_cache = torch.zeros((2, 8, 2, 32), device=device)
    v_cache = torch.zeros_like(k_cache)
    q = torch.arange(3 * 4 * 32, dtype=torch.float32, device=device).view(3, 4, 32)
    k, v = q[:, :2].clone(), q[:, 2:].clone()
    expected_q = q.clone()
    angles = torch.ones((4, 16), device=device)
    angles[0] = 0.0  # cos 1, sin 0
    slots = torch.tensor([5, -1, 9], dtype=torch.int64, device=device)

    rotate_and_write_kv(
        q, k, v, torch.zeros(3, dtype=torch.int64, device=device), angles.cos(), angles.sin(),
        k_cache, v_cache, slots,
    )  # fmt: skip

    assert torch.equal(q, expected_q)
    assert torch.equal(k_cache.view(16, 2, 32)[5], k[0])
    assert torch.equal(k_cache.view(16, 2, 32)[9], k[2])
    assert torch.equal(v_cache.view(16, 2, 32)[9], v[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # rows of slots 5 and 9 only


# (num_heads, num_kv_heads, head_dim, dtype, cache dtype, k_scale): odd head counts, Qwen3-0.6B's
# heads, and an FP8 cache with and without a checkpoint scale.
QK_NORM_CASES = [
    (6, 3, 64, torch.float16, torch.float16, 1.0),
    (16, 8, 128, torch.float16, torch.float16, 1.0),
    (6, 3, 64, torch.bfloat16, torch.bfloat16, 1.0),
    (16, 8, 128, torch.bfloat16, torch.bfloat16, 1.0),
    (5, 5, 32, torch.float32, torch.float32, 1.0),
    pytest.param(6, 3, 64, torch.float16, FP8, 1.0, marks=needs_fp8_gpu),
    pytest.param(16, 8, 128, torch.bfloat16, FP8, 1.0, marks=needs_fp8_gpu),
    pytest.param(16, 8, 128, torch.bfloat16, FP8, 0.5, marks=needs_fp8_gpu),
]
# Absolute tolerance on the normed and rotated values (|x| < 8): the kernel's fp32 sum may put a
# normed value one step of the dtype from the reference's, and the rotation mixes two such
# values. In bf16, four steps at 4..8 (2^-5 each): the interpreter narrows to bf16 by
# truncation, one more step at each of its three roundings.
QK_NORM_ATOL = {torch.float32: 1e-5, torch.float16: 2**-7, torch.bfloat16: 2**-3}


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "cache_dtype", "k_scale"), QK_NORM_CASES
)
def test_rotate_and_write_kv_with_qk_norm_matches_norm_rotary_then_write(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    k_scale: float,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    num_blocks, block_size, num_tokens, max_position, eps = 5, 16, 11, 300, 1e-6
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = random_tensor(shape, dtype, device, generator).to(cache_dtype)
    v_cache = random_tensor(shape, dtype, device, generator).to(cache_dtype)
    angles = torch.rand((max_position, head_dim // 2), generator=generator, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator, device=device)
    # Rows far from unit RMS (x 4) and weights far from 1, so a missing norm cannot pass.
    q_weight = (torch.rand(head_dim, generator=generator, device=device) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, generator=generator, device=device) * 2 - 1).to(dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (4 * random_tensor((num_tokens, width), torch.float32, device, generator)).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator, device=device)[:num_tokens]
    slots[[2, 9]] = -1  # padding rows: q still normed and rotated, nothing stored
    k_before, v_before = k.clone(), v.clone()
    expected_q = rotary_ref(rms_norm_ref(q, q_weight, eps)[0], positions, cos, sin)
    expected_k = rotary_ref(rms_norm_ref(k, k_weight, eps)[0], positions, cos, sin)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    if cache_dtype == FP8:
        expected_k = quantize_fp8_ref(expected_k, k_scale)
        v_stored = quantize_fp8_ref(v, 1.0)
    else:
        v_stored = v
    write_kv_ref(expected_k, v_stored, expected_k_cache, expected_v_cache, slots)

    rotate_and_write_kv(
        q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale,
        q_norm_weight=q_weight, k_norm_weight=k_weight, norm_eps=eps,
    )  # fmt: skip

    atol = QK_NORM_ATOL[dtype]
    torch.testing.assert_close(q, expected_q, rtol=0.0, atol=atol)
    if cache_dtype == FP8:
        # A value a step of the dtype away may narrow to the neighbouring e4m3 step (2^-3 of the
        # value's binade).
        torch.testing.assert_close(k_cache.float(), expected_k_cache.float(), rtol=2**-3, atol=0)
    else:
        torch.testing.assert_close(k_cache, expected_k_cache, rtol=0.0, atol=atol)
    assert torch.equal(v_cache.float(), expected_v_cache.float()), "v is stored unchanged"
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k and v are only read"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no_k_weight", "q_norm_weight and k_norm_weight must be given together"),
        ("no_eps", "norm_eps must be positive, got None"),
        ("eps_alone", "norm_eps is given without q_norm_weight"),
        ("weight_shape", r"k_norm_weight shape \(16,\) != \(32,\)"),
        ("weight_dtype", "q_norm_weight is torch.float16, q is torch.float32"),
    ],
)
def test_rotate_and_write_kv_rejects_bad_qk_norm(
    change: str, message: str, device: torch.device
) -> None:
    q = torch.ones((3, 4, 32), device=device)
    k = torch.ones((3, 2, 32), device=device)
    cache = torch.zeros((2, 8, 2, 32), device=device)
    table = torch.ones((4, 16), device=device)
    q_weight: torch.Tensor | None = torch.ones(32, device=device)
    k_weight: torch.Tensor | None = torch.ones(32, device=device)
    eps: float | None = 1e-6
    if change == "no_k_weight":
        k_weight = None
    elif change == "no_eps":
        eps = None
    elif change == "eps_alone":
        q_weight = k_weight = None
    elif change == "weight_shape":
        k_weight = torch.ones(16, device=device)
    elif change == "weight_dtype":
        q_weight = torch.ones(32, dtype=torch.float16, device=device)
    with pytest.raises(AssertionError, match=message):
        rotate_and_write_kv(
            q, k, k, torch.zeros(3, dtype=torch.int64, device=device), table, table, cache,
            cache.clone(), torch.arange(3, device=device),
            q_norm_weight=q_weight, k_norm_weight=k_weight, norm_eps=eps,
        )  # fmt: skip
