from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.kv_write import rotate_and_write_kv, write_kv
from pagekeeper_engine.kernels.reference import rotary_ref, write_kv_ref
from tests.engine.kernels.paged_cases import random_tensor

HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


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
