from __future__ import annotations

import itertools

import pytest
import torch

from pagekeeper_engine.kernels.paged_decode import SplitRule, choose_num_splits, paged_decode
from pagekeeper_engine.kernels.reference import paged_decode_ref
from tests.engine.kernels.paged_cases import (
    TOLERANCE,
    make_paged_cache,
    random_tensor,
    relative_error,
)

# (group, num_kv_heads, head_dim, block_size, dtype, num_splits, block_n); seq lengths below are
# odd and end inside a block, and one sequence has a single token.
CASES = [
    *[
        (group, 2 if group == 1 else 1, head_dim, block_size, torch.float32, 1 + i % 3, 16)
        for i, (group, head_dim, block_size) in enumerate(
            itertools.product((1, 4, 8), (64, 128), (8, 16, 32))
        )
    ],
    (4, 1, 128, 16, torch.float32, 1, 32),
    (4, 2, 64, 16, torch.float16, 4, 16),
    (8, 1, 128, 8, torch.float16, 2, 64),
]
SEQ_LENS = [1, 17, 45, 70]


def _run_case(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    block_n: int,
    seq_lens: list[int],
    device: torch.device,
    gen: torch.Generator,
) -> None:
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    num_heads = group * num_kv_heads
    # q as a strided view of a fused projection output, out as a view into a larger buffer.
    qkv = random_tensor((len(seq_lens), num_heads + 2, head_dim), dtype, device, gen)
    q = qkv[:, :num_heads]
    out_buffer = torch.full(
        (len(seq_lens), num_heads + 1, head_dim), float("nan"), dtype=dtype, device=device
    )
    out = out_buffer[:, 1:]
    scale = head_dim**-0.5

    paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.seq_lens,
        scale,
        out=out,
        num_splits=num_splits,
        block_n=block_n,
    )

    ref = paged_decode_ref(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale
    )
    assert not out.isnan().any(), "some output element was never written"
    assert out_buffer[:, 0].isnan().all(), "the kernel wrote outside out's view"
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
    # A one-token context returns that token's value exactly (softmax of a single score is 1).
    first_block = int(cache.block_tables[0, 0])
    value = cache.v_cache[first_block, 0].repeat_interleave(group, dim=0)
    assert torch.allclose(out[0].float(), value.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "block_size", "dtype", "num_splits", "block_n"), CASES
)
def test_paged_decode_matches_reference(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    block_n: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    _run_case(
        group,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        num_splits,
        block_n,
        SEQ_LENS,
        device,
        generator,
    )


def test_more_splits_than_tiles_leaves_empty_splits_harmless(
    device: torch.device, generator: torch.Generator
) -> None:
    # 8 splits of 16-token tiles over sequences of 1..33 tokens: most splits are empty.
    _run_case(4, 1, 64, 16, torch.float32, 8, 16, [1, 9, 33], device, generator)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_paged_decode_gpu_shapes(
    dtype: torch.dtype, num_splits: int, device: torch.device, generator: torch.Generator
) -> None:
    seq_lens = [1, 129, 1000, 2047, 3001, 517]
    _run_case(8, 4, 128, 16, dtype, num_splits, 64, seq_lens, device, generator)
    _run_case(4, 2, 128, 32, dtype, num_splits, 32, seq_lens, device, generator)


def test_choose_num_splits() -> None:
    # 1 sequence x 8 KV heads on 132 SMs: 33 wanted, capped at 32 (8192 / 128 would be 64).
    assert choose_num_splits(1, 8, 8192, 132) == 32
    # A short context caps the splits: 700 tokens -> 6 splits of >= 128 tokens.
    assert choose_num_splits(1, 8, 700, 132) == 6
    # 16 x 8 programs already nearly fill one wave: 264 / 128 -> 3.
    assert choose_num_splits(16, 8, 4096, 132) == 3
    # Enough programs for two waves: no split.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(256, 8, 8192, 132) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("q_dtype", "q is torch.float16 but the cache is torch.float32"),
        ("table_dtype", "block_tables must be torch.int32"),
        ("seq_lens_len", "seq_lens has 3 entries, not 2"),
        ("group", "q has 3 heads, not a multiple of the cache's 2 KV heads"),
        ("splits", "num_splits 33 outside"),
        ("cache_layout", "caches must be contiguous"),
    ],
)
def test_paged_decode_rejects_bad_inputs(change: str, message: str, device: torch.device) -> None:
    k_cache = torch.zeros((4, 8, 2, 32), device=device)
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros((2, 4, 32), device=device)
    block_tables = torch.zeros((2, 3), dtype=torch.int32, device=device)
    seq_lens = torch.ones(2, dtype=torch.int32, device=device)
    num_splits = 1
    if change == "q_dtype":
        q = q.half()
    elif change == "table_dtype":
        block_tables = block_tables.long()
    elif change == "seq_lens_len":
        seq_lens = torch.ones(3, dtype=torch.int32, device=device)
    elif change == "group":
        q = torch.zeros((2, 3, 32), device=device)
    elif change == "splits":
        num_splits = 33
    elif change == "cache_layout":
        k_cache = torch.zeros((4, 2, 8, 32), device=device).transpose(1, 2)
    with pytest.raises(AssertionError, match=message):
        paged_decode(q, k_cache, v_cache, block_tables, seq_lens, 1.0, num_splits=num_splits)


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "block_size", "dtype", "num_splits"),
    [
        (4, 2, 64, 16, torch.float32, 3),
        (3, 3, 32, 8, torch.float32, 8),  # group 3: padded head rows in the combine
        (8, 1, 128, 32, torch.float16, 5),
    ],
)
# (1, 1): every sequence uses every split it has tokens for, as the reduce kernel's launch does;
# (32, 128): at 5 or more splits the sequences of 1..129 tokens use 1, 1, 2, 3 and 5 live
# splits, the 1-token and 17-token ones write `out` directly; (24, 128): a split is still two
# 16-token tiles; (8, 32): splits of one 16-token tile up to 128 tokens, so 129 tokens take the
# long rule, 5 splits of 32.
@pytest.mark.parametrize(
    "split_rule", [SplitRule(1, 1), SplitRule(24, 128), SplitRule(32, 128), SplitRule(8, 32)]
)
def test_in_launch_reduce_matches_reference_and_leaves_counters_zero(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int,
    split_rule: SplitRule,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    seq_lens = [1, 17, 45, 70, 129]
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator)
    num_heads = group * num_kv_heads
    q = random_tensor((len(seq_lens), num_heads, head_dim), dtype, device, generator)
    counters = torch.zeros(len(seq_lens) * num_kv_heads + 3, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    ref = paged_decode_ref(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale
    )
    two_launches = paged_decode(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale,
        num_splits=num_splits, block_n=16,
    )  # fmt: skip

    for _ in range(2):  # the second call relies on the first leaving the counters at zero
        out = torch.full_like(q, float("nan"))
        paged_decode(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale, out=out,
            num_splits=num_splits, block_n=16, split_counters=counters,
            split_rule=split_rule,
        )  # fmt: skip
        assert not out.isnan().any(), "some output element was never written"
        error = relative_error(out, ref)
        assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
        assert torch.equal(counters, torch.zeros_like(counters))
    if split_rule == SplitRule(1, 1):
        # Same partials, combined by the same code as the reduce kernel's.
        torch.testing.assert_close(out, two_launches, rtol=1e-6, atol=1e-6)


def test_split_counters_must_cover_every_program(device: torch.device) -> None:
    k_cache = torch.zeros((4, 8, 2, 32), device=device)
    q = torch.zeros((2, 4, 32), device=device)
    with pytest.raises(AssertionError, match="split_counters has 3 entries, fewer than 2"):
        paged_decode(
            q, k_cache, k_cache.clone(), torch.zeros((2, 3), dtype=torch.int32, device=device),
            torch.ones(2, dtype=torch.int32, device=device), 1.0, num_splits=2,
            split_counters=torch.zeros(3, dtype=torch.int32, device=device),
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_split_count_runs_on_one_compiled_kernel(
    device: torch.device, generator: torch.Generator
) -> None:
    # An eager step picks its split count from its batch and longest context; a count that
    # compiled its own kernel would stall serving for the compile the first time it comes up.
    from triton import knobs  # noqa: PLC0415

    seq_lens = [1, 300, 2049, 777]
    cache = make_paged_cache(seq_lens, 16, 2, 128, torch.bfloat16, device, generator)
    q = random_tensor((len(seq_lens), 8, 128), torch.bfloat16, device, generator)
    ref = paged_decode_ref(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.1)
    counters = torch.zeros(len(seq_lens) * 2, dtype=torch.int32, device=device)

    def run(num_splits: int) -> torch.Tensor:
        return paged_decode(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.1,
            num_splits=num_splits, split_counters=counters,
        )  # fmt: skip

    run(1)  # the unsplit kernel, compiled here
    run(2)  # the split one
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        outs = {n: run(n) for n in (1, 3, 5, 8, 13, 32)}
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
    for num_splits, out in outs.items():
        error = relative_error(out, ref)
        assert error < TOLERANCE[torch.bfloat16], f"{num_splits} splits: error {error:.2e}"
    assert int(counters.abs().sum()) == 0, "the fused reduce leaves its counters zero"
