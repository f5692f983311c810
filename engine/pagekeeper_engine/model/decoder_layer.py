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
        quantization: str = "none",
    ):
        super().__init__()
        self.tp = tp
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
            quantization=quantization,
        )
        self.mlp = SwiGLU(
            config.hidden_size, config.intermediate_size, dtype=dtype, quantization=quantization
        )
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
        else:  # the previous layer's MLP left its partial sums (`after_attention`)
            add_summed_and_norm(self.tp, self.input_layernorm, workspace, num_tokens)
        self.self_attn.project_and_write(positions, hidden, meta, workspace)

    def after_attention(self, workspace: Workspace, num_tokens: int) -> None:
        """The output projection, the post-attention norm and the MLP (per-row work only),
        which leaves its partial sums for the next norm (`add_summed_and_norm`)."""
        hidden = workspace.rows("hidden", num_tokens)
        # The o and down projections write this rank's partial sums here: the one-shot
        # buffer's rows when the ranks add them up there, else `hidden`.
        staged = self.tp.partial_rows(num_tokens, hidden.shape[1], hidden.dtype)
        partial = hidden if staged is None else staged.rows
        self.self_attn.project_out(workspace, out=partial)
        add_summed_and_norm(self.tp, self.post_attention_layernorm, workspace, num_tokens)
        self.mlp(hidden, workspace, out=partial)


def add_summed_and_norm(
    tp: TensorParallelGroup, norm: RMSNorm, workspace: Workspace, num_tokens: int
) -> None:
    """residual += the ranks' sum of the partial sums `after_attention` left, and hidden =
    norm(residual): one launch on the one-shot path, an all-reduce (a no-op on one rank) and
    the residual-add norm otherwise."""
    hidden = workspace.rows("hidden", num_tokens)
    residual = workspace.rows("residual", num_tokens)
    staged = tp.partial_rows(num_tokens, hidden.shape[1], hidden.dtype)
    if staged is None:
        tp.all_reduce_(hidden)
        norm.forward_residual_(hidden, residual)
    else:
        staged.reduce_add_norm_(residual, norm.weight, norm.eps, out=hidden)
