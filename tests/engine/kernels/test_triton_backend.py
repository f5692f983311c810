from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagekeeper_engine.attention.base import AttentionMetadata, QKNorm
from pagekeeper_engine.attention.torch_ref import TorchRefBackend
from pagekeeper_engine.attention.triton_backend import TritonAttentionBackend
from pagekeeper_engine.kernels.reference import (
    paged_attention_ref,
    rms_norm_ref,
    rotary_ref,
    write_kv_ref,
)
from tests.engine.kernels.paged_cases import (
    TOLERANCE,
    PagedCache,
    make_paged_cache,
    random_tensor,
    relative_error,
)


@dataclass
class MixedStep:
    cache: PagedCache
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _mixed_step(
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    decodes_only: bool = False,
) -> MixedStep:
    """Three decodes, then two prefill chunks (one after a cached prefix), as the runner packs;
    `decodes_only`: five decodes (one the first token of its sequence)."""
    prefix_lens = [40, 0, 300, 19, 150] if decodes_only else [40, 1, 300, 19, 0]
    q_lens = [1] * 5 if decodes_only else [1, 1, 1, 23, 30]
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    slots = []  # each new token's slot, read off the block tables
    for seq, (prefix, q_len) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        for pos in range(prefix, prefix + q_len):
            block = int(cache.block_tables[seq, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=cache.seq_lens,
        block_tables=cache.block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_seqs=5 if decodes_only else 3,
    )
    num_rows = starts[-1]
    return MixedStep(
        cache=cache,
        meta=meta,
        q=random_tensor((num_rows, group * num_kv_heads, head_dim), dtype, device, gen),
        k=random_tensor((num_rows, num_kv_heads, head_dim), dtype, device, gen),
        v=random_tensor((num_rows, num_kv_heads, head_dim), dtype, device, gen),
    )


@pytest.mark.parametrize(("num_sms", "block_size"), [(1, 8), (64, 16), (4, 32)])
def test_mixed_step_matches_reference(
    num_sms: int, block_size: int, device: torch.device, generator: torch.Generator
) -> None:
    step = _mixed_step(block_size, 2, 4, 64, torch.float32, device, generator)
    cache, meta = step.cache, step.meta
    ref_k_cache, ref_v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    write_kv_ref(step.k, step.v, ref_k_cache, ref_v_cache, meta.slot_mapping)
    ref = paged_attention_ref(
        step.q,
        ref_k_cache,
        ref_v_cache,
        cache.block_tables,
        cache.seq_lens,
        meta.query_start_loc,
        0.1,
    )

    backend = TritonAttentionBackend(num_sms=num_sms)
    out = backend.forward(step.q, step.k, step.v, cache.k_cache, cache.v_cache, meta, 0.1)

    assert backend.name == "triton"
    assert torch.equal(cache.k_cache, ref_k_cache) and torch.equal(cache.v_cache, ref_v_cache)
    assert out.shape == step.q.shape
    error = relative_error(out, ref)
    assert error < TOLERANCE[torch.float32], f"relative error {error:.2e}"


@pytest.mark.parametrize(
    "dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
def test_matches_the_engine_torch_backend(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    """The GPU path and the engine's CPU reference path compute the same attention."""
    step = _mixed_step(16, 2, 8, 128, dtype, device, generator)
    cache, meta = step.cache, step.meta
    ref_k_cache, ref_v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    ref = TorchRefBackend().forward(
        step.q, step.k, step.v, ref_k_cache, ref_v_cache, meta, 128**-0.5
    )

    out = TritonAttentionBackend().forward(
        step.q, step.k, step.v, cache.k_cache, cache.v_cache, meta, 128**-0.5
    )

    assert torch.equal(cache.k_cache, ref_k_cache) and torch.equal(cache.v_cache, ref_v_cache)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


@dataclass
class _Tables:
    """Rotary tables without the model: the fused path reads only cos and sin."""

    cos: torch.Tensor
    sin: torch.Tensor

    def forward_qk(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_ref(q, positions, self.cos, self.sin), rotary_ref(
            k, positions, self.cos, self.sin
        )


def _random_tables(device: torch.device, generator: torch.Generator) -> _Tables:
    """Tables of 400 positions at angles of 0-6 radians (head_dim 64)."""
    angles = torch.rand((400, 32), generator=generator, device=device) * 6
    return _Tables(angles.cos(), angles.sin())


def _far_qk_norm(dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> QKNorm:
    """q/k norm weights far from 1 (head_dim 64), so a missing norm cannot pass."""
    return QKNorm(
        q_weight=(torch.rand(64, generator=generator, device=device) + 0.5).to(dtype),
        k_weight=(torch.rand(64, generator=generator, device=device) * 2 - 1).to(dtype),
        eps=1e-6,
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
def test_forward_rotary_equals_rotary_then_forward(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    """The fused rotary + KV write path: same cache and (up to rounding) same attention."""
    step = _mixed_step(16, 2, 4, 64, dtype, device, generator)
    cache, meta = step.cache, step.meta
    angles = torch.rand((400, 32), generator=generator, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 400, (step.q.shape[0],), generator=generator, device=device)
    ref_k_cache, ref_v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    ref = TritonAttentionBackend(num_sms=4).forward(
        rotary_ref(step.q, positions, cos, sin),
        rotary_ref(step.k, positions, cos, sin),
        step.v,
        ref_k_cache,
        ref_v_cache,
        meta,
        0.125,
    )

    tables = _Tables(cos, sin)
    out = TritonAttentionBackend(num_sms=4).forward_rotary(
        step.q, step.k, step.v, positions, tables, cache.k_cache, cache.v_cache, meta, 0.125
    )

    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(cache.k_cache, ref_k_cache, rtol=tol, atol=tol)
    assert torch.equal(cache.v_cache, ref_v_cache)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


# The interpreter's bf16 attention is wrong (relative error ~1e9, `forward` alone too).
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []),
)
def test_forward_rotary_with_qk_norm_matches_the_torch_backend(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    """Qwen3's q/k norm fused into the KV write against the reference path (norm, rotary, then
    `forward`): the same cache and attention, and q normed and rotated in place."""
    step = _mixed_step(16, 2, 4, 64, dtype, device, generator)
    cache, meta = step.cache, step.meta
    tables = _random_tables(device, generator)
    positions = torch.randint(0, 400, (step.q.shape[0],), generator=generator, device=device)
    # Rows far from unit RMS and weights far from 1, so a missing norm cannot pass.
    q, k = 4 * step.q, 4 * step.k
    qk_norm = _far_qk_norm(dtype, device, generator)
    ref_k_cache, ref_v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    ref = TorchRefBackend().forward_rotary(
        q.clone(), k.clone(), step.v, positions, tables, ref_k_cache, ref_v_cache, meta, 0.125,
        qk_norm=qk_norm,
    )  # fmt: skip
    ref_q = rotary_ref(
        rms_norm_ref(q, qk_norm.q_weight, 1e-6)[0], positions, tables.cos, tables.sin
    )

    out = TritonAttentionBackend(num_sms=4).forward_rotary(
        q, k, step.v, positions, tables, cache.k_cache, cache.v_cache, meta, 0.125,
        qk_norm=qk_norm,
    )  # fmt: skip

    # As in test_kv_write.py's q/k norm test: a few steps of the dtype at |x| < 8.
    atol = {torch.float32: 1e-5, torch.float16: 2**-7, torch.bfloat16: 2**-3}[dtype]
    torch.testing.assert_close(q, ref_q, rtol=0.0, atol=atol)
    torch.testing.assert_close(cache.k_cache, ref_k_cache, rtol=0.0, atol=atol)
    assert torch.equal(cache.v_cache, ref_v_cache)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("num_sms", [4, 64])  # one split; three (301 tokens at 128 a split)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []),
)
def test_forward_rotary_of_decodes_alone_matches_the_torch_backend(
    num_sms: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    """A step of decodes alone takes the one-launch path (`rotary_decode`): the reference's
    cache and attention, and q as projected, not rotated in place."""
    step = _mixed_step(16, 2, 4, 64, dtype, device, generator, decodes_only=True)
    cache, meta = step.cache, step.meta
    tables = _random_tables(device, generator)
    positions = cache.seq_lens.long() - 1
    q, k = 4 * step.q, 4 * step.k
    qk_norm = _far_qk_norm(dtype, device, generator)
    ref_k_cache, ref_v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    ref = TorchRefBackend().forward_rotary(
        q.clone(), k.clone(), step.v, positions, tables, ref_k_cache, ref_v_cache, meta, 0.125,
        qk_norm=qk_norm,
    )  # fmt: skip
    q_before = q.clone()

    out = TritonAttentionBackend(num_sms=num_sms).forward_rotary(
        q, k, step.v, positions, tables, cache.k_cache, cache.v_cache, meta, 0.125,
        qk_norm=qk_norm,
    )  # fmt: skip

    atol = {torch.float32: 1e-5, torch.float16: 2**-7, torch.bfloat16: 2**-3}[dtype]
    torch.testing.assert_close(cache.k_cache, ref_k_cache, rtol=0.0, atol=atol)
    assert torch.equal(cache.v_cache, ref_v_cache)
    assert torch.equal(q, q_before)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


def test_forward_rotary_of_many_decodes_writes_then_attends(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, generator: torch.Generator
) -> None:
    """Past `ONE_LAUNCH_MAX_SEQS` decodes the step takes the two launches (q rotated in place)
    and gives the same result."""
    from pagekeeper_engine.attention import triton_backend  # noqa: PLC0415

    step = _mixed_step(16, 2, 4, 64, torch.float32, device, generator, decodes_only=True)
    cache, meta = step.cache, step.meta
    tables = _random_tables(device, generator)
    positions = cache.seq_lens.long() - 1
    backend = TritonAttentionBackend(num_sms=4)
    k_one, v_one, q_one = cache.k_cache.clone(), cache.v_cache.clone(), step.q.clone()
    one = backend.forward_rotary(q_one, step.k, step.v, positions, tables, k_one, v_one, meta, 0.1)
    monkeypatch.setattr(triton_backend, "ONE_LAUNCH_MAX_SEQS", meta.num_seqs - 1)
    q_two = step.q.clone()
    two = backend.forward_rotary(
        q_two, step.k, step.v, positions, tables, cache.k_cache, cache.v_cache, meta, 0.1
    )
    assert torch.equal(q_one, step.q), "one launch: q as projected"
    torch.testing.assert_close(q_two, rotary_ref(step.q, positions, tables.cos, tables.sin))
    assert torch.equal(cache.k_cache, k_one) and torch.equal(cache.v_cache, v_one)
    assert relative_error(two, one) < 1e-6


def test_fp8_decode_tiles_follow_whether_the_launch_is_split() -> None:
    # Split to fill the GPU (a few sequences): four warps a program; sequences enough to fill
    # it alone (one split): two, so that more programs stay resident. bf16 keeps four.
    from pagekeeper_engine.kernels import FP8_CACHE_DTYPE  # noqa: PLC0415

    backend = TritonAttentionBackend(num_sms=132)
    fp8 = torch.empty((4, 16, 8, 128), dtype=FP8_CACHE_DTYPE)
    few, many = backend._decode_options(1, fp8, 2048), backend._decode_options(256, fp8, 2048)
    assert few["num_splits"] > 1 and (few["num_warps"], few["num_stages"]) == (4, 5)
    assert many["num_splits"] == 1 and (many["num_warps"], many["num_stages"]) == (2, 5)
    bf16 = backend._decode_options(256, fp8.to(torch.bfloat16), 2048)
    assert (bf16["num_warps"], bf16["num_stages"]) == (4, 3)
