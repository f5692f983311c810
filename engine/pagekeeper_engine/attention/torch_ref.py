"""Reference attention over the paged KV cache in plain torch: correct, not fast.

It runs the engine on the CPU and is the oracle the Triton kernels are tested against. Each
sequence's keys are gathered from its block table into a contiguous (seq_len, ...) tensor, so
what it computes is exactly the layout contract of `attention/base.py`, nothing more.
"""

from __future__ import annotations

import torch

from pagekeeper_engine.attention.base import UNSCALED, AttentionBackend, AttentionMetadata, KVScales


def write_kv_cache(
    k: torch.Tensor,  # (T, num_kv_heads, head_dim)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64; a negative slot marks a padding row
) -> None:
    """Store each new token's key and value at its flat cache slot."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[is_real].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[is_real].to(v_cache.dtype))


def gather_sequence_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks_per_seq,) int32
    seq_len: int,
) -> torch.Tensor:
    """The first seq_len cached entries of one sequence, (seq_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (num_blocks, block_size, Hkv, D)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,  # (T, num_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # (T, num_heads, head_dim), written in full
) -> torch.Tensor:
    """Causal attention of each query row over its sequence's cached keys (GQA aware)."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros_like(q) if out is None else out.zero_()
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        keys = gather_sequence_kv(k_cache, meta.block_tables[b], seq_len)
        values = gather_sequence_kv(v_cache, meta.block_tables[b], seq_len)
        # Query head h reads kv head h // group: (seq_len, H, D) after the repeat.
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].float()  # (query_len, H, D)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale  # (H, query_len, seq_len)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        is_future = key_pos[None, :] > query_pos[:, None]  # (query_len, seq_len)
        scores = scores.masked_fill(is_future, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class TorchRefBackend(AttentionBackend):
    """The CPU backend: plain-torch cache write and per-sequence attention."""

    name = "torch_ref"

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNSCALED,
    ) -> None:
        if kv_scales != UNSCALED:
            k, v = k / kv_scales.k, v / kv_scales.v
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNSCALED,
        pdl: bool = False,
    ) -> torch.Tensor:
        if kv_scales == UNSCALED:
            return paged_attention_ref(q, k_cache, v_cache, meta, scale, out)
        result = paged_attention_ref(q, k_cache, v_cache, meta, scale * kv_scales.k, out)
        return result.mul_(kv_scales.v)
