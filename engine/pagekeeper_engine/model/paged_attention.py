"""The decoder's self-attention over the paged KV cache (`PagedAttention`): its projections, its
q/k norms (Qwen3), and the backend that writes this step's keys and values and attends."""

from __future__ import annotations

import torch
from torch import nn

from pagekeeper_engine.attention.base import (
    UNSCALED,
    AttentionBackend,
    AttentionMetadata,
    QKNorm,
)
from pagekeeper_engine.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagekeeper_engine.model.workspace import Workspace


class PagedAttention(nn.Module):
    """Self-attention whose keys and values live in the paged KV cache of its layer.

    The runner binds `k_cache`/`v_cache` (num_blocks, block_size, num_kv_heads, head_dim) once
    after allocating the pool; the backend writes this step's keys there and reads the rest.
    Under tensor parallelism the heads are this rank's and the output projection writes this
    rank's partial sums, which the decoder layer adds up over the ranks.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm_eps: float | None,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        quantization: str = "none",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(
            hidden_size, qkv_size, bias=bias, dtype=dtype, quantization=quantization
        )
        self.o_proj = Linear(
            self.q_size, hidden_size, bias=False, dtype=dtype, quantization=quantization
        )
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype) if qk_norm_eps else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype) if qk_norm_eps else None
        self.rotary = rotary
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The checkpoint's scales, when it has them (`CausalLM.load_weight`); used by an FP8
        # cache only (`CausalLM.bind_kv_cache`).
        self.checkpoint_kv_scales = UNSCALED
        self.kv_scales = UNSCALED

    @property
    def qk_norm(self) -> QKNorm | None:
        """Qwen3's per-head q and k norms, handed to the backend to apply before the rotary
        embedding (both norms share `qk_norm_eps`)."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def project_and_write(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        meta: AttentionMetadata,
        workspace: Workspace,
    ) -> None:
        """x: (T, H) -> the workspace's `qkv` rows, q normed and rotated there, and this step's
        keys and values in the cache. Reads only per-token inputs (of `meta`, the slots)."""
        qkv = self.qkv_proj(x, out=workspace.rows("qkv", x.shape[0]))
        self.write(positions, qkv, meta)

    def attend_cached(self, meta: AttentionMetadata, workspace: Workspace, num_tokens: int) -> None:
        """The workspace's q rows -> its `attn` rows: attention over the cache as `meta`
        describes it (this step's keys already written by `project_and_write`)."""
        qkv = workspace.rows("qkv", num_tokens)
        self.read(qkv, meta, out=workspace.rows("attn", num_tokens))

    def project_out(self, workspace: Workspace, out: torch.Tensor) -> None:
        """The workspace's `attn` rows -> out (T, H): this rank's partial sums under tensor
        parallelism, not yet added up over the ranks."""
        self.o_proj(workspace.rows("attn", out.shape[0]), out=out)

    def attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        pdl: bool = False,
    ) -> None:
        """qkv: (T, q + 2 kv), the projection's output -> out (T, q_size): this step's keys and
        values written to the cache, then the attention of q over it. The backend norms and
        rotates q and k on the way, in one launch at a small step of decodes alone (q may be
        left rotated in place in qkv, or not). The one-token fused layer's attention
        (`model/row_fusion.py`); the other forwards write and read in separate stages
        (`model/stages.py`). `pdl`: see `AttentionBackend.write_rotary`."""
        k_cache, v_cache = self._cache()
        q, k, v = self._heads(qkv)
        self.backend.forward_rotary(
            q,
            k,
            v,
            positions,
            self.rotary,
            k_cache,
            v_cache,
            meta,
            self.scale,
            out=out.view(qkv.shape[0], self.num_heads, self.head_dim),
            kv_scales=self.kv_scales,
            qk_norm=self.qk_norm,
            pdl=pdl,
        )

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the projection's output, (T, heads, head_dim) views each."""
        num_tokens = qkv.shape[0]
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def _cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        return self.k_cache, self.v_cache

    def write(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, pdl: bool = False
    ) -> None:
        """Norm (Qwen3) and rotate q in place in qkv; store rotary(norm(k)) and v."""
        k_cache, v_cache = self._cache()
        q, k, v = self._heads(qkv)
        # The Triton backend norms and rotates inside its KV write, saving up to three launches
        # a layer.
        self.backend.write_rotary(
            q,
            k,
            v,
            positions,
            self.rotary,
            k_cache,
            v_cache,
            meta,
            kv_scales=self.kv_scales,
            qk_norm=self.qk_norm,
            pdl=pdl,
        )

    def read(
        self, qkv: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor, pdl: bool = False
    ) -> None:
        """q of qkv (already normed and rotated) -> out (T, q_size)."""
        k_cache, v_cache = self._cache()
        num_tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        self.backend.attend(
            q,
            k_cache,
            v_cache,
            meta,
            self.scale,
            out=out.view(num_tokens, self.num_heads, self.head_dim),
            kv_scales=self.kv_scales,
            pdl=pdl,
        )
