"""One decoder layer: pre-norm attention and SwiGLU blocks around a residual stream, in the
three parts the forward pass is cut into (`model/stages.py`): the per-row work before the
attention, the attention over the cache, and the per-row work after it."""

from __future__ import annotations

import torch
from torch import nn

from pagekeeper_engine.attention.base import AttentionBackend, AttentionMetadata
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.model.hf_config import ModelConfig
from pagekeeper_engine.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from pagekeeper_engine.model.paged_attention import PagedAttention
from pagekeeper_engine.model.workspace import Workspace


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU blocks around a residual stream."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ):
        super().__init__()
        self.self_attn = PagedAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            bias=config.attention_bias,
            qk_norm_eps=config.rms_norm_eps if config.has_qk_norm else None,
            rotary=rotary,
            backend=backend,
            dtype=dtype,
            tp=tp,
        )
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )

    def before_attention(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        workspace: Workspace,
        *,
        is_first: bool,
    ) -> None:
        """The input norm (the residual added first), the qkv projection and the KV write
        (per-row work only). The first layer finds the embeddings in `residual` and nothing
        yet in `hidden`."""
        num_tokens = positions.shape[0]
        hidden = workspace.rows("hidden", num_tokens)
        residual = workspace.rows("residual", num_tokens)
        if is_first:
            self.input_layernorm(residual, out=hidden)
        else:
            self.input_layernorm.forward_residual_(hidden, residual)
        self.self_attn.project_and_write(positions, hidden, meta, workspace)

    def after_attention(self, workspace: Workspace, num_tokens: int) -> None:
        """The output projection, the post-attention norm and the MLP (per-row work only)."""
        hidden = workspace.rows("hidden", num_tokens)
        residual = workspace.rows("residual", num_tokens)
        self.self_attn.project_out(workspace, out=hidden)
        self.post_attention_layernorm.forward_residual_(hidden, residual)
        self.mlp(hidden, workspace, out=hidden)
