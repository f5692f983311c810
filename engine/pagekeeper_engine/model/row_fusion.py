"""A one-token decoder layer in four projections: the batch-1 decode step's launch count.

A batch-1 step reads every weight once, and its small kernels cost more than their bytes: on
an H200 a Qwen3-0.6B step launched 322 kernels, of which 113 RMSNorms at 1.4 us each against a
floor of 0.28 ms for the whole step's weights (docs/benchmarks.md, run 17). Here each
projection runs the GEMV (`kernels/gemv.py`) with the work around it folded in:

    qkv      = GEMV(norm(residual))                  input_layernorm in the prologue
    attn     = attention(qkv)                        q/k norm and rotary in the KV write
    residual += GEMV(attn)                           o_proj, the residual add in the epilogue
    act      = SwiGLU(GEMV(norm(residual)))          post_attention_layernorm and SwiGLU
    residual += GEMV(act)                            down_proj

so the residual stream stays in `residual` and no separate norm, add or activation is launched.
The arithmetic is the unfused layer's: every value is rounded where the separate kernels round
it. Only without tensor parallelism (the partial sums would need an all-reduce before the add).
Which tile each GEMV uses is the start-up choice (`model/gemv_choice.py`), the first candidate
where it kept cuBLAS; that choice also decides whether the fused layer runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekeeper_engine.attention.base import AttentionMetadata
from pagekeeper_engine.model.layers import Linear, PagedAttention, RMSNorm, SwiGLU
from pagekeeper_engine.model.workspace import Workspace


@dataclass(frozen=True)
class RowFusion:
    """The fused one-token layer is on; `pdl`: its kernels launch as programmatic dependents
    (`kernels.supports_pdl`)."""

    pdl: bool = False


def forward_one_row(
    attention: PagedAttention,
    mlp: SwiGLU,
    norms: tuple[RMSNorm, RMSNorm],  # the layer's input and post-attention norms
    positions: torch.Tensor,
    meta: AttentionMetadata,
    workspace: Workspace,
    fusion: RowFusion,
) -> None:
    """Advance the one-token residual stream in `workspace` by one decoder layer, in place."""
    from pagekeeper_engine.kernels import gemv as kernel  # noqa: PLC0415 (imports triton)

    residual = workspace.rows("residual", 1)
    input_norm, post_attention_norm = norms

    def project(
        linear: Linear,
        x: torch.Tensor,
        out: torch.Tensor,
        norm: RMSNorm | None = None,
        epilogue: kernel.Epilogue = kernel.Epilogue.STORE,
    ) -> torch.Tensor:
        return kernel.gemv(
            x,
            linear.weight,
            linear.bias,
            out=out,
            config=linear.gemv_config or kernel.CANDIDATES[0],
            norm=None if norm is None else kernel.RowNorm(norm.weight, norm.eps),
            epilogue=epilogue,
            pdl=fusion.pdl,
        )

    qkv = project(attention.qkv_proj, residual, workspace.rows("qkv", 1), norm=input_norm)
    attn = workspace.rows("attn", 1)
    attention.attend(positions, qkv, meta, out=attn, pdl=fusion.pdl)
    project(attention.o_proj, attn, residual, epilogue=kernel.Epilogue.ADD)
    act = project(
        mlp.gate_up_proj,
        residual,
        workspace.rows("act", 1),
        norm=post_attention_norm,
        epilogue=kernel.Epilogue.SWIGLU,
    )
    project(mlp.down_proj, act, residual, epilogue=kernel.Epilogue.ADD)
