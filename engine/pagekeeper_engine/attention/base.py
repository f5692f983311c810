"""The attention interface: one backend computes attention over the paged KV cache.

KV cache layout (per layer): `k_cache`, `v_cache` of shape (num_blocks, block_size, num_kv_heads,
head_dim). Token `t` of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its flat slot is `block_id * block_size + offset`.

A step packs B sequences' new tokens into T rows (decodes first, then prefill chunks). Query row i
of sequence b sits at absolute position `seq_lens[b] - query_len_b + i` and attends causally to
every cached key at a position <= its own (the prefix already cached, plus the new keys).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer; built once by the model runner."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot for each new token's key and value
    query_start_loc: torch.Tensor  # (B + 1,) int32: cumulative query lengths, [0] == 0
    seq_lens: torch.Tensor  # (B,) int32: tokens of each sequence after this step
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int  # the first num_decode_seqs sequences have query length 1

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs


class RotaryTables(Protocol):
    """The model's rotary embedding, as a backend that rotates inside its KV write needs it."""

    cos: torch.Tensor  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor

    def forward_qk(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class KVScales(NamedTuple):
    """The KV cache holds key / k and value / v: an FP8 cache's per-layer scales from the
    checkpoint (vLLM's `k_scale` / `v_scale`), 1.0 otherwise."""

    k: float = 1.0
    v: float = 1.0


UNSCALED = KVScales()


@dataclass(frozen=True, eq=False)
class QKNorm:
    """An RMSNorm over each head of q and of k, before the rotary embedding (Qwen3)."""

    q_weight: torch.Tensor  # (head_dim,) in q's dtype
    k_weight: torch.Tensor  # (head_dim,)
    eps: float

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New normed (q, k): (T, heads, head_dim) each, as the model's `RMSNorm` computes."""
        return _rms_norm_heads(q, self.q_weight, self.eps), _rms_norm_heads(
            k, self.k_weight, self.eps
        )


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, the normalised value rounded to x's dtype before the weight multiply:
    # `RMSNorm._norm` in model/layers.py, which the kernels match.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class AttentionBackend(ABC):
    """Writes a step's keys and values into the cache (`write`), then attends over it
    (`attend`).

    The two halves are separate so that a caller can run them apart: `write` reads only
    per-token tensors (the new keys, values, positions and `meta.slot_mapping`), so it may sit
    inside a CUDA graph captured at a fixed token count, while `attend` reads the per-sequence
    metadata, which changes from step to step (`runner/piecewise_graphs.py`).
    """

    name: str

    @abstractmethod
    def write(
        self,
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNSCALED,
    ) -> None:
        """Store k / kv_scales.k and v / kv_scales.v at `meta.slot_mapping` (a negative slot
        stores nothing)."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # (T, num_heads, head_dim): where the result goes
        kv_scales: KVScales = UNSCALED,
        pdl: bool = False,
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        """Causal attention of q over the cache as `meta` describes it (this step's keys already
        written), in `out` when given (e.g. a view of the step's workspace). Only the rows in
        `meta.query_start_loc`'s range get a result (a graph's padding rows have none)."""

    def write_rotary(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim), normed and rotated in place
        k: torch.Tensor,  # (T, num_kv_heads, head_dim), read only: the cache gets its rotation
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        positions: torch.Tensor,  # (T,) int64
        rotary: RotaryTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNSCALED,
        qk_norm: QKNorm | None = None,
        pdl: bool = False,
    ) -> None:
        """`write` of rotary(k) and v, and q rotated in place; with `qk_norm`, of
        rotary(norm(k)) and q := rotary(norm(q)). A backend that can norm and rotate inside its
        KV write overrides this to save the separate launches; one whose kernels can launch as
        programmatic dependents of the kernel before them does so with `pdl` (others ignore
        it)."""
        normed_q, normed_k = (q, k) if qk_norm is None else qk_norm.apply(q, k)
        rotated_q, rotated_k = rotary.forward_qk(positions, normed_q, normed_k)
        q.copy_(rotated_q)
        self.write(rotated_k, v, k_cache, v_cache, meta, kv_scales)

    def forward(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNSCALED,
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        """Store k and v at `meta.slot_mapping`, then return causal attention of q."""
        self.write(k, v, k_cache, v_cache, meta, kv_scales)
        return self.attend(q, k_cache, v_cache, meta, scale, out, kv_scales)

    def forward_rotary(
        self,
        q: torch.Tensor,  # (T, num_heads, head_dim), normed and rotated in place
        k: torch.Tensor,  # (T, num_kv_heads, head_dim), not yet rotated
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        positions: torch.Tensor,  # (T,) int64
        rotary: RotaryTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNSCALED,
        qk_norm: QKNorm | None = None,
        pdl: bool = False,
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        """`forward` of rotary(q), rotary(k), v, or with `qk_norm` of rotary(norm(q)),
        rotary(norm(k)), v: `write_rotary`, then `attend`."""
        self.write_rotary(
            q, k, v, positions, rotary, k_cache, v_cache, meta, kv_scales, qk_norm, pdl
        )
        return self.attend(q, k_cache, v_cache, meta, scale, out, kv_scales, pdl)
