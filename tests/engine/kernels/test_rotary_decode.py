"""The fused decode (`rotary_decode`) against its two launches in a row: `rotate_and_write_kv`,
then `paged_decode` of the rotated q. The cache must hold the same bytes, and the output must be
theirs; a split that read the newest slot before it was written would miss the new token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagekeeper_engine.kernels.kv_write import rotate_and_write_kv
from pagekeeper_engine.kernels.paged_decode import SplitRule, paged_decode
from pagekeeper_engine.kernels.rotary_decode import rotary_decode
from tests.engine.kernels.paged_cases import (
    PagedCache,
    make_paged_cache,
    needs_fp8_gpu,
    random_tensor,
    relative_error,
)

FP8 = torch.float8_e4m3fn
# Relative error allowed between the fused and the two-launch outputs: rounding of the output's
# dtype at most (the attention's own error against a reference is `paged_decode`'s tests').
SAME_DOTS = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# (group, num_kv_heads, head_dim, block_size, dtype, num_splits, min_split_tokens, qk_norm)
CASES = [
    (1, 2, 64, 16, torch.float32, 1, 64, False),
    (2, 2, 64, 8, torch.float32, 3, 16, True),
    (4, 1, 128, 16, torch.float32, 4, 1, False),
    # A launch sized for a longer context: 16 splits, of which at most 2 hold tokens here.
    (2, 2, 64, 16, torch.float32, 16, 16, False),
    (2, 3, 64, 32, torch.float16, 2, 16, True),
    *[(4, 2, 128, 16, dtype, 5, 16, True) for dtype in HALF_DTYPES],
]
# One token (its only key is the new one), tokens ending inside and at the end of a block, and
# a padding row (slot -1: nothing stored, its output unread).
SEQ_LENS = [1, 17, 45, 64, 70, 3]
PADDING_ROW = 5
REAL_ROWS = [row for row in range(len(SEQ_LENS)) if row != PADDING_ROW]


@dataclass
class DecodeCase:
    """One decode token per sequence, as projected, with the tables and slots to place it."""

    cache: PagedCache
    q: torch.Tensor  # (B, heads, head_dim)
    k: torch.Tensor  # (B, kv heads, head_dim)
    v: torch.Tensor
    positions: torch.Tensor  # (B,) int64: seq_lens - 1
    slots: torch.Tensor  # (B,) int64; -1 at PADDING_ROW
    cos: torch.Tensor
    sin: torch.Tensor
    norm: dict[str, Any]  # the q/k norm's keyword arguments, or none


@dataclass
class Launched:
    """What a path left: its output and the caches it wrote."""

    out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _decode_case(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    qk_norm: bool,
    cache_dtype: torch.dtype | None = None,
) -> DecodeCase:
    cache = make_paged_cache(SEQ_LENS, block_size, num_kv_heads, head_dim, dtype, device, gen)
    if cache_dtype is not None:
        cache.k_cache, cache.v_cache = cache.k_cache.to(cache_dtype), cache.v_cache.to(cache_dtype)
    num_heads, num_seqs = group * num_kv_heads, len(SEQ_LENS)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (4 * random_tensor((num_seqs, width), torch.float32, device, gen)).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    positions = cache.seq_lens.long() - 1
    rows = torch.arange(num_seqs, device=device)
    slots = cache.block_tables[rows, positions // block_size].long() * block_size
    slots += positions % block_size
    slots[PADDING_ROW] = -1
    angles = torch.rand((128, head_dim // 2), generator=gen, device=device) * 6
    norm: dict[str, Any] = {}
    if qk_norm:
        norm = {
            "q_norm_weight": (torch.rand(head_dim, generator=gen, device=device) + 0.5).to(dtype),
            "k_norm_weight": (torch.rand(head_dim, generator=gen, device=device) * 2 - 1).to(dtype),
            "norm_eps": 1e-6,
        }
    return DecodeCase(
        cache=cache,
        q=q,
        k=k.view(num_seqs, num_kv_heads, head_dim),
        v=v.view(num_seqs, num_kv_heads, head_dim),
        positions=positions,
        slots=slots,
        cos=angles.cos(),
        sin=angles.sin(),
        norm=norm,
    )


def _both(
    case: DecodeCase,
    num_splits: int,
    min_split_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Launched, Launched]:
    """The two launches in a row, then the one launch, each on its own copy of the cache."""
    cache, q, k, v, norm = case.cache, case.q, case.k, case.v, case.norm
    scale = q.shape[2] ** -0.5
    counters = torch.zeros(64, dtype=torch.int32, device=q.device)
    splits = {"num_splits": num_splits, "split_rule": SplitRule(short_tokens=min_split_tokens)}
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    k_two, v_two, q_two = cache.k_cache.clone(), cache.v_cache.clone(), q.clone()
    rotate_and_write_kv(
        q_two, k, v, case.positions, case.cos, case.sin, k_two, v_two, case.slots, **scales, **norm
    )
    out_two = paged_decode(
        q_two, k_two, v_two, cache.block_tables, cache.seq_lens, scale,
        split_counters=counters, **scales, **splits,
    )  # fmt: skip

    k_one, v_one, q_before = cache.k_cache.clone(), cache.v_cache.clone(), q.clone()
    out_one = rotary_decode(
        q, k, v, case.positions, case.cos, case.sin, k_one, v_one, case.slots,
        cache.block_tables, cache.seq_lens, scale,
        split_counters=counters, **scales, **splits, **norm,
    )  # fmt: skip
    assert torch.equal(q, q_before), "q is only read"
    assert int(counters.abs().sum()) == 0, "the split counters are left at zero"
    return Launched(out_two, k_two, v_two), Launched(out_one, k_one, v_one)


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "block_size", "dtype", "num_splits", "min_split", "norm"),
    CASES,
)
def test_rotary_decode_is_the_rotary_write_then_the_decode(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    min_split: int,
    norm: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    case = _decode_case(group, num_kv_heads, head_dim, block_size, dtype, device, generator, norm)
    two, one = _both(case, num_splits, min_split)
    assert torch.equal(one.k_cache, two.k_cache), "the same cache bytes"
    assert torch.equal(one.v_cache, two.v_cache), "the same cache bytes"
    # The same values into the same dots; compiled, q comes from registers rather than memory,
    # and the dot's accumulation order may differ in the last bits (a missed new token would
    # move a 17-token row by ~6%).
    assert relative_error(one.out[REAL_ROWS], two.out[REAL_ROWS]) < SAME_DOTS[dtype]


def test_rotary_decode_sees_the_new_token(device: torch.device, generator: torch.Generator) -> None:
    """A one-token sequence's output is its new value: read back from the cache just written."""
    case = _decode_case(2, 2, 64, 16, torch.float32, device, generator, qk_norm=True)
    _, one = _both(case, 4, 1)
    expected = case.v[0].repeat_interleave(2, dim=0)  # (heads, head_dim): each KV head's value
    torch.testing.assert_close(one.out[0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("num_splits", [1, 6])
def test_rotary_decode_over_an_fp8_cache(
    num_splits: int, device: torch.device, generator: torch.Generator
) -> None:
    case = _decode_case(2, 8, 128, 16, torch.bfloat16, device, generator, True, cache_dtype=FP8)
    two, one = _both(case, num_splits, 16, k_scale=2.0, v_scale=0.5)
    assert torch.equal(one.k_cache.view(torch.uint8), two.k_cache.view(torch.uint8))
    assert torch.equal(one.v_cache.view(torch.uint8), two.v_cache.view(torch.uint8))
    assert relative_error(one.out[REAL_ROWS], two.out[REAL_ROWS]) < SAME_DOTS[torch.bfloat16]
