from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.paged_prefill import paged_prefill
from pagekeeper_engine.kernels.reference import paged_attention_ref
from tests.engine.kernels.paged_cases import (
    TOLERANCE,
    make_paged_cache,
    random_tensor,
    relative_error,
)

# (prefix_len, query_len) per sequence: a whole prompt; a chunk after an earlier chunk that ends
# inside a block; a chunk after a block-aligned prefix-cache hit; one row after a long prefix;
# a short prompt.
SEQS = [(0, 37), (21, 19), (16, 20), (70, 1), (0, 5)]
NUM_LEADING_ROWS = 2  # rows the prefill kernel must leave alone (the batch's decode rows)


def _run_case(
    seqs: list[tuple[int, int]],
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    block_m: int,
    block_n: int,
    device: torch.device,
    gen: torch.Generator,
) -> None:
    seq_lens = [prefix + q_len for prefix, q_len in seqs]
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q_lens = [q_len for _, q_len in seqs]
    starts = [NUM_LEADING_ROWS]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    num_heads = group * num_kv_heads
    num_rows = starts[-1] + 3  # trailing padding rows, also left alone
    q = random_tensor((num_rows, num_heads + 2, head_dim), dtype, device, gen)[:, 1 : 1 + num_heads]
    out = torch.full((num_rows, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    scale = head_dim**-0.5

    paged_prefill(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.seq_lens,
        query_start_loc,
        max(q_lens),
        scale,
        out=out,
        block_m=block_m,
        block_n=block_n,
    )

    rows = slice(starts[0], starts[-1])
    assert not out[rows].isnan().any(), "some output row of a sequence was never written"
    assert out[: starts[0]].isnan().all() and out[starts[-1] :].isnan().all(), (
        "the kernel wrote rows outside query_start_loc's range"
    )
    ref = paged_attention_ref(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, query_start_loc, scale
    )
    error = relative_error(out[rows], ref[rows])
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
    # The first row of a fresh prompt sees only itself: its output is its own value.
    first_block = int(cache.block_tables[0, 0])
    value = cache.v_cache[first_block, 0].repeat_interleave(group, dim=0)
    assert torch.allclose(out[starts[0]].float(), value.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "block_size", "dtype", "block_m", "block_n"),
    [
        (1, 2, 64, 8, torch.float32, 16, 16),
        (4, 1, 128, 16, torch.float32, 16, 32),
        (8, 1, 64, 32, torch.float32, 32, 16),
        (4, 2, 128, 8, torch.float32, 64, 64),
        (1, 1, 128, 32, torch.float32, 16, 64),
        (8, 1, 128, 16, torch.float16, 16, 16),
        (4, 1, 64, 32, torch.float16, 64, 32),
    ],
)
def test_paged_prefill_matches_reference(
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    block_m: int,
    block_n: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    _run_case(
        SEQS, group, num_kv_heads, head_dim, block_size, dtype, block_m, block_n, device, generator
    )


def test_chunked_prefill_equals_whole_prefill(
    device: torch.device, generator: torch.Generator
) -> None:
    """A prompt run in three chunks gives the rows the one-shot prefill gives."""
    prompt_len, num_kv_heads, group, head_dim = 53, 1, 4, 64
    cache = make_paged_cache(
        [prompt_len], 8, num_kv_heads, head_dim, torch.float32, device, generator
    )
    q = random_tensor((prompt_len, group, head_dim), torch.float32, device, generator)
    whole = paged_prefill(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.seq_lens,
        torch.tensor([0, prompt_len], dtype=torch.int32, device=device),
        prompt_len,
        0.125,
        block_m=16,
        block_n=16,
    )
    chunked = torch.full_like(q, float("nan"))
    for start, end in ((0, 20), (20, 21), (21, prompt_len)):
        paged_prefill(
            q[start:end],
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            torch.tensor([end], dtype=torch.int32, device=device),
            torch.tensor([0, end - start], dtype=torch.int32, device=device),
            end - start,
            0.125,
            out=chunked[start:end],
            block_m=16,
            block_n=16,
        )
    assert relative_error(chunked, whole) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_m", "block_n"), [(64, 64), (128, 64)])
def test_paged_prefill_gpu_shapes(
    dtype: torch.dtype,
    block_m: int,
    block_n: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    seqs = [(0, 1000), (512, 333), (1111, 77), (2000, 1), (0, 129)]
    _run_case(seqs, 8, 2, 128, 16, dtype, block_m, block_n, device, generator)
    _run_case(seqs, 4, 2, 64, 32, dtype, block_m, block_n, device, generator)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("qsl_len", "query_start_loc has 2 entries, expected 3"),
        ("qsl_dtype", "query_start_loc must be torch.int32"),
        ("out_dtype", "out is torch.float16, q is torch.float32"),
        ("block_m", "block_m 48 not a power of 2"),
        ("block_size", "block size 64 is not one of"),
    ],
)
def test_paged_prefill_rejects_bad_inputs(change: str, message: str, device: torch.device) -> None:
    block_size = 64 if change == "block_size" else 8
    k_cache = torch.zeros((4, block_size, 1, 32), device=device)
    q = torch.zeros((5, 2, 32), device=device)
    out = torch.empty_like(q)
    block_tables = torch.zeros((2, 3), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    block_m = 16
    if change == "qsl_len":
        query_start_loc = query_start_loc[:2]
    elif change == "qsl_dtype":
        query_start_loc = query_start_loc.long()
    elif change == "out_dtype":
        out = out.half()
    elif change == "block_m":
        block_m = 48
    with pytest.raises(AssertionError, match=message):
        paged_prefill(
            q,
            k_cache,
            k_cache.clone(),
            block_tables,
            seq_lens,
            query_start_loc,
            3,
            1.0,
            out=out,
            block_m=block_m,
        )
