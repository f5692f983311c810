"""The torch reference backend against dense causal attention without any paging."""

from __future__ import annotations

import torch

from pagekeeper_engine.attention.base import AttentionMetadata, QKNorm
from pagekeeper_engine.attention.registry import get_backend
from pagekeeper_engine.attention.torch_ref import TorchRefBackend, write_kv_cache
from pagekeeper_engine.model.layers import RMSNorm, RotaryEmbedding

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 16


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (Lq, H, D) at the last Lq positions of k, v (L, Hkv, D): plain causal attention."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    offset = k.shape[0] - q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=offset)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_paged_matches_dense_for_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    # (cached tokens before the step, new tokens, block table): a decode, an extend over a
    # cached prefix (as after a prefix-cache hit), and a fresh prefill, with scattered blocks.
    layout = [(9, 1, [7, 2, 11]), (5, 6, [4, 13, 0]), (0, 7, [9, 5])]
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    full_k, full_v, slots, q_rows = [], [], [], []
    for cached, new, blocks in layout:
        total = cached + new
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        seq_slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)]
        # The cached prefix is already in the cache from earlier steps.
        write_kv_cache(
            k[:cached],
            v[:cached],
            k_cache,
            v_cache,
            torch.tensor(seq_slots[:cached], dtype=torch.long),
        )
        full_k.append(k)
        full_v.append(v)
        slots.extend(seq_slots[cached:])
        q_rows.append(torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen))
    width = max(len(b) for _, _, b in layout)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, 1, 7, 14], dtype=torch.int32),
        seq_lens=torch.tensor([10, 11, 7], dtype=torch.int32),
        block_tables=torch.tensor(
            [b + [0] * (width - len(b)) for _, _, b in layout], dtype=torch.int32
        ),
        max_query_len=7,
        max_seq_len=11,
        num_decode_seqs=1,
    )
    new_k = torch.cat([k[c:] for k, (c, _, _) in zip(full_k, layout, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _, _) in zip(full_v, layout, strict=True)])
    scale = HEAD_DIM**-0.5
    out = TorchRefBackend().forward(torch.cat(q_rows), new_k, new_v, k_cache, v_cache, meta, scale)
    expected = torch.cat(
        [dense_attention(q, k, v, scale) for q, k, v in zip(q_rows, full_k, full_v, strict=True)]
    )
    assert out.shape == (14, NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new keys landed at exactly their slots, e.g. the decode token (position 9) in block 11.
    torch.testing.assert_close(k_cache[11, 1], full_k[0][9])
    torch.testing.assert_close(v_cache[0, 2], full_v[1][10])


def test_write_skips_padding_slots() -> None:
    k_cache = torch.zeros(2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv_cache(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.sum().item() == 2 * NUM_KV_HEADS * HEAD_DIM
    assert k_cache[1, 1].eq(1).all() and k_cache[0, 0].eq(1).all()
    assert v_cache[1, 1].eq(2).all()


def test_cpu_gets_the_reference_backend() -> None:
    assert get_backend("cpu").name == "torch_ref"


def test_forward_rotary_norms_q_and_k_before_rotating() -> None:
    """The reference path of Qwen3's q/k norm, bit for bit: the model's RMSNorm over each head,
    then its rotary embedding, then `forward`."""
    gen = torch.Generator().manual_seed(1)
    dtype, num_tokens = torch.bfloat16, 5
    q = (4 * torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)).to(dtype)
    k = (4 * torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q_norm, k_norm = RMSNorm(HEAD_DIM, 1e-6, dtype=dtype), RMSNorm(HEAD_DIM, 1e-6, dtype=dtype)
    q_norm.weight.copy_(torch.rand(HEAD_DIM, generator=gen) + 0.5)
    k_norm.weight.copy_(torch.rand(HEAD_DIM, generator=gen) * 2 - 1)
    rotary = RotaryEmbedding(HEAD_DIM, 16, 10000.0, None)
    positions = torch.arange(num_tokens)
    meta = AttentionMetadata(  # one prefill of 5 tokens in blocks 3 and 1
        slot_mapping=torch.tensor([12, 13, 14, 15, 4]),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([[3, 1]], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        num_decode_seqs=0,
    )
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = TorchRefBackend().forward(
        rotary(positions, q_norm(q)), rotary(positions, k_norm(k)), v, ref_k_cache, ref_v_cache,
        meta, scale,
    )  # fmt: skip

    out = TorchRefBackend().forward_rotary(
        q, k, v, positions, rotary, k_cache, v_cache, meta, scale,
        qk_norm=QKNorm(q_norm.weight, k_norm.weight, 1e-6),
    )  # fmt: skip

    assert torch.equal(out, expected)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
    assert k_cache.abs().sum() > 0 and torch.equal(k_cache[0], torch.zeros_like(k_cache[0]))
