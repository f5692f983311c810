"""One decoder for the Llama family, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

The forward pass takes the step's packed tokens and returns hidden states; logits are computed
separately, only for the rows that will be sampled. Under tensor parallelism (`tp`) the model is
one rank's shard (`model/shard.py`): its heads, MLP columns and vocabulary rows, with the
partial sums all-reduced; a rank's logits are its vocabulary shard's (`gather_logits` joins
them). Shapes depend only on the number of tokens, so a caller may pad to fixed sizes and
capture the forward in a CUDA graph. Every per-token temporary lives in a `Workspace`
(`model/workspace.py`): the one bound with `bind_workspace`, or, for a caller that bound none,
one allocated for the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional

from pagekeeper_engine.attention.base import (
    UNSCALED,
    AttentionBackend,
    AttentionMetadata,
    KVScales,
)
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.model.checkpoint_weights import CheckpointWeights
from pagekeeper_engine.model.decoder_layer import DecoderLayer, add_summed_and_norm
from pagekeeper_engine.model.hf_config import ModelConfig
from pagekeeper_engine.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagekeeper_engine.model.offload import LayerOffload, move_to_host
from pagekeeper_engine.model.row_fusion import RowFusion, forward_one_row
from pagekeeper_engine.model.shard import ShardPlan
from pagekeeper_engine.model.stages import ForwardStages
from pagekeeper_engine.model.workspace import Workspace, WorkspaceShape


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (the checkpoint's `model.` prefix)."""

    def __init__(
        self,
        config: ModelConfig,
        max_position: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        quantization: str = "none",
        offload_layer_ids: Sequence[int] = (),
    ):
        super().__init__()
        self.tp = tp
        self.vocab_start = tp.rank * config.vocab_size  # this rank's first row of the vocabulary
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling
        )

        def layer(i: int) -> DecoderLayer:
            if i not in offload_layer_ids:
                return DecoderLayer(config, rotary, backend, dtype, tp, quantization)
            device = torch.get_default_device()
            with torch.device("cpu"):  # its weights never touch the GPU (`model/offload.py`)
                built = DecoderLayer(config, rotary, backend, dtype, tp, quantization)
            move_to_host(built, device)
            return built

        self.layers = nn.ModuleList(layer(i) for i in range(config.num_layers))
        self.offload_layer_ids = tuple(offload_layer_ids)
        # Made once the weights are loaded (`start_offload`): None runs every layer resident.
        self.offload: LayerOffload | None = None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        # Set by the runner's start-up choice (`model/gemv_choice.py`): one-token steps run
        # the fused layer of `model/row_fusion.py`.
        self.row_fusion: RowFusion | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        workspace: Workspace,
    ) -> torch.Tensor:
        """(T, H) hidden states: a view of the workspace's `hidden` rows."""
        num_tokens = input_ids.shape[0]
        if self.row_fusion is not None and num_tokens == 1 and not self.tp.is_active:
            residual = workspace.rows("residual", 1)
            self._embed(input_ids, out=residual)
            statistic = None  # the residual's sums of squares, from one layer to the next
            offload = self.offload
            if offload is not None:
                offload.start()
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)
                norms = (layer.input_layernorm, layer.post_attention_layernorm)
                attention, mlp = layer.self_attn, layer.mlp
                if offload is not None:
                    offload.begin(i)
                statistic = forward_one_row(
                    i, attention, mlp, norms, positions, meta, workspace, self.row_fusion, statistic
                )
                if offload is not None:
                    offload.end(i)
            hidden = workspace.rows("hidden", 1)
            self.norm(residual, out=hidden)
            return hidden
        return self.stages(input_ids, positions, meta, workspace).run(meta)

    def stages(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        workspace: Workspace,
    ) -> ForwardStages:
        """This forward pass cut at each layer's attention (`model/stages.py`); the dense stages
        read `input_ids`, `positions` and `meta.slot_mapping` only."""
        num_tokens = input_ids.shape[0]
        residual = workspace.rows("residual", num_tokens)
        hidden = workspace.rows("hidden", num_tokens)
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        offload = self.offload

        def first() -> None:
            self._embed(input_ids, out=residual)
            if offload is not None:
                offload.start()
                offload.begin(0)
            layers[0].before_attention(positions, meta, workspace, is_first=True)

        def between(i: int) -> Callable[[], None]:
            before, after = layers[i], layers[i + 1]

            def dense() -> None:
                before.after_attention(workspace, num_tokens)
                if offload is not None:
                    offload.end(i)
                    offload.begin(i + 1)
                after.before_attention(positions, meta, workspace, is_first=False)

            return dense

        def last() -> None:
            layers[-1].after_attention(workspace, num_tokens)
            if offload is not None:
                offload.end(len(layers) - 1)
            add_summed_and_norm(self.tp, self.norm, workspace, num_tokens)

        def attention(layer: DecoderLayer) -> Callable[[AttentionMetadata], None]:
            return lambda step_meta: layer.self_attn.attend_cached(step_meta, workspace, num_tokens)

        dense = [first, *(between(i) for i in range(len(layers) - 1)), last]
        return ForwardStages(dense, [attention(layer) for layer in layers], hidden, input_ids)

    def start_offload(self) -> None:
        """Stage the offloaded layers' weights from here on (once they are loaded)."""
        if self.offload_layer_ids:
            device = self.embed_tokens.weight.device
            self.offload = LayerOffload(self.layers, self.offload_layer_ids, device)

    def _embed(self, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        """(T,) ids -> (T, H) embeddings; a rank holding a shard of the vocabulary looks up its
        own rows, zeroes the others, and the sum over ranks is the embedding."""
        weight = self.embed_tokens.weight
        if not self.tp.is_active:
            torch.index_select(weight, 0, input_ids, out=out)
            return
        local = input_ids - self.vocab_start
        is_mine = (local >= 0) & (local < weight.shape[0])
        torch.index_select(weight, 0, local.clamp(0, weight.shape[0] - 1), out=out)
        out.mul_(is_mine.unsqueeze(1).to(out.dtype))
        self.tp.all_reduce_(out)


class CausalLM(CheckpointWeights):
    """A decoder-only language model over a paged KV cache: the whole of it, or with `tp` of
    size > 1, the shard of rank `tp.rank` (`config` is always the whole model's)."""

    def __init__(
        self,
        config: ModelConfig,
        max_position: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        tp: TensorParallelGroup | None = None,
        quantization: str = "none",
        offload_layer_ids: Sequence[int] = (),
    ):
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup()
        self.quantization = quantization  # of the decoder layers' projections (`model/fp8.py`)
        self.shard = ShardPlan.for_rank(config, self.tp.rank, self.tp.size)
        self.vocab_size = config.vocab_size
        # [start, stop) of the vocabulary on each rank, in rank order (`gather_logits`).
        self.vocab_columns = [self.shard.of_rank(r).vocab_columns for r in range(self.tp.size)]
        config = self.shard.local_config
        self.config = config  # this rank's: its heads, MLP columns and vocabulary shard
        self.model = DecoderModel(
            config, max_position, backend, dtype, self.tp, quantization, offload_layer_ids
        )
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.workspace: Workspace | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give each layer its (k_cache, v_cache) views of the preallocated pool. An FP8 pool
        stores values over the checkpoint's scales where it has them; other dtypes unscaled."""
        assert len(kv_caches) == len(self.model.layers), "one (k, v) cache pair per layer"
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            attn.k_cache = k_cache
            attn.v_cache = v_cache
            is_fp8 = k_cache.dtype == torch.float8_e4m3fn
            attn.kv_scales = attn.checkpoint_kv_scales if is_fp8 else UNSCALED

    def unbind_kv_cache(self) -> None:
        """Drop every layer's views of the bound pool, so that freeing the pool frees it."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.k_cache = layer.self_attn.v_cache = None

    @property
    def checkpoint_kv_scales(self) -> list[KVScales]:
        """Each layer's KV scales as the checkpoint gave them (1.0 where it gave none)."""
        return [
            layer.self_attn.checkpoint_kv_scales
            for layer in self.model.layers
            if isinstance(layer, DecoderLayer)
        ]

    def set_row_fusion(self, fusion: RowFusion | None) -> None:
        """Run one-token forwards through the fused layer (`model/row_fusion.py`), or not."""
        self.model.row_fusion = fusion

    def bind_workspace(self, workspace: Workspace | None) -> None:
        """Run every later forward pass in `workspace` (None: one allocated per call)."""
        self.workspace = workspace

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden_size). With a bound
        workspace they are a view of it, valid until the next forward pass."""
        workspace = self.workspace
        if workspace is None:
            shape = WorkspaceShape.for_model(self.config, max(int(input_ids.shape[0]), 1))
            workspace = Workspace(shape, self.lm_head_weight.dtype, input_ids.device)
        hidden: torch.Tensor = self.model(input_ids, positions, meta, workspace)
        return hidden

    def stages(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> ForwardStages:
        """`forward` over the bound workspace, cut at each layer's attention
        (`model/stages.py`)."""
        assert self.workspace is not None, "a staged forward runs in the bound workspace"
        return self.model.stages(input_ids, positions, meta, self.workspace)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: (N, hidden_size) -> this rank's logits (N, config.vocab_size) in the model's
        dtype, as the lm_head writes them (the sampler reads them so; `.float()` where fp32 is
        wanted): the whole vocabulary on one GPU, the rank's shard of it under tensor
        parallelism (`gather_logits` joins the shards). With `out` (the model's dtype, at
        least N rows), written into its leading rows: no allocation of the step's size."""
        if out is None:
            return functional.linear(hidden, self.lm_head_weight)
        return torch.mm(hidden, self.lm_head_weight.t(), out=out[: hidden.shape[0]])

    def gather_logits(
        self,
        local: torch.Tensor,
        gathered: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Every rank's `compute_logits` rows (N, shard) -> the whole (N, vocab_size) on rank 0,
        each shard's padding columns cut off; None on the other ranks. Rank 0 receives the
        shards in `gathered` (size, >= N, shard) and writes `out`'s leading rows where they are
        given: nothing of the step's size is allocated then."""
        num_rows, shard = local.shape
        if self.tp.is_first and gathered is None:
            gathered = local.new_empty(self.tp.size, num_rows, shard)
        parts = None if gathered is None else gathered[:, :num_rows]
        self.tp.gather_(parts, local)
        if parts is None:
            return None
        whole = local.new_empty(num_rows, self.vocab_size) if out is None else out[:num_rows]
        for rank, (start, stop) in enumerate(self.vocab_columns):
            whole[:, start:stop].copy_(parts[rank, :, : stop - start])
        return whole
