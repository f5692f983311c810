"""A one-token decoder layer in four projections: the batch-1 decode step's launch count.

A batch-1 step reads every weight once, and its small kernels cost more than their bytes: on an H200
a Qwen3-0.6B step launched 322 kernels, of which 113 RMSNorms at 1.4 us each against a floor of
0.28 ms for the whole step's weights (docs/benchmarks-archive.md, "fewer launches a step"). Here
each projection runs the GEMV (`kernels/gemv.py`) with the work around it folded in:

    qkv      = GEMV(norm(residual))                  input_layernorm in the prologue
    attn     = attention(qkv)                        q/k norm and rotary in the KV write
    residual += GEMV(attn)                           o_proj, the residual add in the epilogue
    act      = SwiGLU(GEMV(norm(residual)))          post_attention_layernorm and SwiGLU
    residual += GEMV(act)                            down_proj

so the residual stream stays in `residual` and no separate norm, add or activation is launched.
Each residual-adding projection also writes the partial sums of the squares of the values it
stores (one per program) to the workspace's `statistics`, so the normed projection after it
adds those up for its norm's statistic instead of every program first passing over x (only the
first layer's input norm makes that pass).
The arithmetic is the unfused layer's: every value is rounded where the separate kernels round
it; the sums of squares are fp32 in another order. Only without tensor parallelism (the
partial sums would need an all-reduce before the add).
Which tile each GEMV uses is the start-up choice (`model/gemv_choice.py`), the first candidate
where it kept cuBLAS; that choice also decides whether the fused layer runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekeeper_engine.attention.base import AttentionMetadata
from pagekeeper_engine.model.layers import Linear, RMSNorm, SwiGLU
from pagekeeper_engine.model.paged_attention import PagedAttention
from pagekeeper_engine.model.workspace import Workspace


@dataclass(frozen=True)
class RowFusion:
    """The fused one-token layer is on; `pdl`: its kernels launch as programmatic dependents
    (`kernels.supports_pdl`)."""

    pdl: bool = False


def forward_one_row(
    layer: int,
    attention: PagedAttention,
    mlp: SwiGLU,
    norms: tuple[RMSNorm, RMSNorm],  # the layer's input and post-attention norms
    positions: torch.Tensor,
    meta: AttentionMetadata,
    workspace: Workspace,
    fusion: RowFusion,
    input_statistic: torch.Tensor | None,  # what the layer before returned; None: layer 0
) -> torch.Tensor:
    """Advance the one-token residual stream in `workspace` by decoder layer `layer`, in place;
    the partial sums of squares of the residual it leaves, for the next layer's input norm.
    Layer i keeps its statistics in rows 2i + 1 and 2i + 2 of `workspace.statistics`."""
    from pagekeeper_engine.kernels import gemv as kernel  # noqa: PLC0415 (imports triton)

    residual = workspace.rows("residual", 1)
    input_norm, post_attention_norm = norms

    def config(linear: Linear) -> kernel.GemvConfig:
        return linear.gemv_config or kernel.CANDIDATES[0]

    def statistic(row: int, producer: Linear) -> torch.Tensor:
        """Row `row`'s entries for `producer`'s programs over the residual's columns."""
        parts = kernel.programs(residual.shape[1], config(producer))
        return workspace.statistics[row, :parts]

    def project(
        linear: Linear,
        x: torch.Tensor,
        out: torch.Tensor,
        norm: RMSNorm | None = None,
        norm_statistic: torch.Tensor | None = None,
        epilogue: kernel.Epilogue = kernel.Epilogue.STORE,
        statistic_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return kernel.gemv(
            x,
            linear.weight,
            linear.bias,
            out=out,
            config=config(linear),
            norm=None if norm is None else kernel.RowNorm(norm.weight, norm.eps, norm_statistic),
            epilogue=epilogue,
            sum_squares_out=statistic_out,
            pdl=fusion.pdl,
            weight_scale=linear.weight_scale,
        )

    qkv = project(
        attention.qkv_proj,
        residual,
        workspace.rows("qkv", 1),
        norm=input_norm,
        norm_statistic=input_statistic,
    )
    attn = workspace.rows("attn", 1)
    attention.attend(positions, qkv, meta, out=attn, pdl=fusion.pdl)
    after_attention = statistic(2 * layer + 1, attention.o_proj)
    project(
        attention.o_proj,
        attn,
        residual,
        epilogue=kernel.Epilogue.ADD,
        statistic_out=after_attention,
    )
    act = project(
        mlp.gate_up_proj,
        residual,
        workspace.rows("act", 1),
        norm=post_attention_norm,
        norm_statistic=after_attention,
        epilogue=kernel.Epilogue.SWIGLU,
    )
    after_layer = statistic(2 * layer + 2, mlp.down_proj)
    project(mlp.down_proj, act, residual, epilogue=kernel.Epilogue.ADD, statistic_out=after_layer)
    return after_layer
