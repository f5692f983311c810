"""The FP8 (e4m3) KV cache: the KV write narrows to FP8, decode and prefill attention read it and
compute in the query's dtype, each against the torch reference over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.reference import (
    dequantize_fp8_ref,
    paged_attention_ref,
    paged_decode_ref,
    quantize_fp8_ref,
)
from tests.engine.kernels.paged_cases import (
    make_paged_cache,
    needs_fp8_gpu,
    random_tensor,
    relative_error,
)

FP8 = torch.float8_e4m3fn
# Relative error of attention over an FP8 cache against the same attention over that cache
# dequantized: the kernels' own rounding only (bf16 dots), as in their bf16 tests.
TOLERANCE = 2e-2


def test_e4m3_rounds_to_nearest_and_saturates_in_torch() -> None:
    """The reference narrowing (CPU): 3 mantissa bits, the largest finite value 448."""
    values = torch.tensor([1.0, 1.0625, 1.1875, 300.0, 448.0, -0.001953125])
    narrowed = values.to(FP8).float()
    assert narrowed.tolist() == [1.0, 1.0, 1.25, 288.0, 448.0, -0.001953125]
    assert float(torch.finfo(FP8).max) == 448.0


def test_a_scale_stores_values_past_448_and_gives_them_back() -> None:
    """The quantization reference (CPU): the cache holds x / scale; x = stored x scale."""
    values = torch.tensor([1000.0, -1000.0, 3.0, 0.0])
    assert quantize_fp8_ref(values, 1.0).float().tolist() == [448.0, -448.0, 3.0, 0.0]
    stored = quantize_fp8_ref(values, 4.0)  # 250 rounds to 256 (e4m3 steps by 16 there)
    assert stored.float().tolist() == [256.0, -256.0, 0.75, 0.0]
    assert dequantize_fp8_ref(stored, 4.0).tolist() == [1024.0, -1024.0, 3.0, 0.0]


@pytest.mark.gpu
@needs_fp8_gpu
def test_kv_write_divides_by_the_checkpoint_scales(device: torch.device) -> None:
    from pagekeeper_engine.kernels.kv_write import write_kv  # noqa: PLC0415

    k = torch.tensor([[[1000.0, -3.0, 0.5, 2.0] * 4]], dtype=torch.bfloat16, device=device)
    v = 2 * k
    k_cache = torch.zeros((2, 16, 1, 16), dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k, v, k_cache, v_cache, torch.tensor([3], device=device), 4.0, 0.5)
    assert torch.equal(k_cache[0, 3].float(), quantize_fp8_ref(k[0], 4.0).float())
    assert torch.equal(v_cache[0, 3].float(), quantize_fp8_ref(v[0], 0.5).float())


@pytest.mark.gpu
@needs_fp8_gpu
def test_kv_write_narrows_to_fp8_and_saturates(device: torch.device) -> None:
    from pagekeeper_engine.kernels.kv_write import write_kv  # noqa: PLC0415

    row = [1.0625, 1000.0, -1000.0, 0.5] * 4  # head_dim 16
    k = torch.tensor([[row]], dtype=torch.bfloat16, device=device)
    v = -k
    k_cache = torch.zeros((2, 16, 1, 16), dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k, v, k_cache, v_cache, torch.tensor([17], device=device))
    assert k_cache[1, 1, 0].float().tolist() == [1.0, 448.0, -448.0, 0.5] * 4
    assert v_cache[1, 1, 0].float().tolist() == [-1.0, -448.0, 448.0, -0.5] * 4
    assert k_cache.float().abs().sum() == k_cache[1, 1, 0].float().abs().sum()


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("num_splits", [1, 7])
def test_paged_decode_reads_an_fp8_cache(
    num_splits: int, device: torch.device, generator: torch.Generator
) -> None:
    from pagekeeper_engine.kernels.paged_decode import paged_decode  # noqa: PLC0415

    seq_lens = [1, 129, 1000, 2047, 517]
    cache = make_paged_cache(seq_lens, 16, 8, 128, torch.bfloat16, device, generator)
    k8, v8 = cache.k_cache.to(FP8), cache.v_cache.to(FP8)
    q = random_tensor((len(seq_lens), 32, 128), torch.bfloat16, device, generator)
    out = paged_decode(
        q, k8, v8, cache.block_tables, cache.seq_lens, 128**-0.5, num_splits=num_splits
    )
    ref = paged_decode_ref(
        q,
        k8.to(torch.bfloat16),
        v8.to(torch.bfloat16),
        cache.block_tables,
        cache.seq_lens,
        128**-0.5,
    )
    assert relative_error(out, ref) < TOLERANCE


@pytest.mark.gpu
@needs_fp8_gpu
def test_paged_prefill_reads_an_fp8_cache(device: torch.device, generator: torch.Generator) -> None:
    from pagekeeper_engine.kernels.paged_prefill import paged_prefill  # noqa: PLC0415

    seqs = [(0, 37), (100, 64), (515, 200)]  # (cached prefix, new rows)
    seq_lens = [p + n for p, n in seqs]
    cache = make_paged_cache(seq_lens, 16, 8, 128, torch.bfloat16, device, generator)
    k8, v8 = cache.k_cache.to(FP8), cache.v_cache.to(FP8)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    q = random_tensor((starts[-1], 32, 128), torch.bfloat16, device, generator)
    args = (cache.block_tables, cache.seq_lens, query_start_loc)
    out = paged_prefill(q, k8, v8, *args, max(n for _, n in seqs), 128**-0.5)
    ref = paged_attention_ref(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), *args, 128**-0.5)
    assert relative_error(out, ref) < TOLERANCE


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("num_splits", [1, 7])
def test_attention_reads_a_scaled_fp8_cache(
    num_splits: int, device: torch.device, generator: torch.Generator
) -> None:
    """Keys stored over 0.25 and values over 3.0: decode and prefill attend over what the
    entries stand for (the reference dequantizes them)."""
    from pagekeeper_engine.kernels.paged_decode import paged_decode  # noqa: PLC0415
    from pagekeeper_engine.kernels.paged_prefill import paged_prefill  # noqa: PLC0415

    k_scale, v_scale = 0.25, 3.0
    seq_lens = [1, 129, 1000, 517]
    cache = make_paged_cache(seq_lens, 16, 8, 128, torch.bfloat16, device, generator)
    k8, v8 = quantize_fp8_ref(cache.k_cache, k_scale), quantize_fp8_ref(cache.v_cache, v_scale)
    k_ref = dequantize_fp8_ref(k8, k_scale).to(torch.bfloat16)
    v_ref = dequantize_fp8_ref(v8, v_scale).to(torch.bfloat16)
    q = random_tensor((len(seq_lens), 32, 128), torch.bfloat16, device, generator)
    scale = 128**-0.5
    out = paged_decode(
        q, k8, v8, cache.block_tables, cache.seq_lens, scale, num_splits=num_splits,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    ref = paged_decode_ref(q, k_ref, v_ref, cache.block_tables, cache.seq_lens, scale)
    assert relative_error(out, ref) < TOLERANCE
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    args = (cache.block_tables, cache.seq_lens, starts)
    out = paged_prefill(q, k8, v8, *args, 1, scale, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(out, paged_attention_ref(q, k_ref, v_ref, *args, scale)) < TOLERANCE
