"""How a model takes a Hugging Face checkpoint's tensors: their names and shapes, the fused
q/k/v and gate/up matrices they are packed into, the last vocabulary shard's padding, the FP8
weights and their scales (`model/fp8.py`), and the KV-cache scales of FP8 checkpoints.

`CheckpointWeights` is `CausalLM`'s half that the loader (`model/loader.py`) calls.
"""

from __future__ import annotations

import torch
from torch import nn

from pagekeeper_engine.attention.base import KVScales
from pagekeeper_engine.model.fp8 import FP8_DTYPE, WEIGHT_SCALE_NAMES
from pagekeeper_engine.model.hf_config import ModelConfig
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.model.paged_attention import PagedAttention

# Checkpoint tensor -> (our fused parameter, index of its row slice in pack order).
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# A layer's KV-cache scales in FP8 checkpoints (under `self_attn.`; kv_scale sets both).
_KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")
# Tensors with a row per vocabulary entry (sharded by rows under tensor parallelism).
_VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")
# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# FP8 checkpoints' static activation scales (`model/fp8.py` scales activations dynamically).
_ACTIVATION_SCALE_SUFFIXES = (".input_scale",)


class CheckpointWeights(nn.Module):
    """Loading a checkpoint into a model's parameters, by the checkpoint's tensor names. The
    model says which of its config (this rank's shard), LM head and quantization it has."""

    config: ModelConfig
    lm_head: Linear | None
    quantization: str

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must provide, by its Hugging Face name, with its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, param in self.named_parameters():
            parent, _, leaf = name.rpartition(".")
            module_path, _, fused = parent.rpartition(".")
            parts = [p for p, (f, _) in _PACKED.items() if f == fused]
            if not parts:
                shapes[name] = tuple(param.shape)
            for part in parts:
                shapes[f"{module_path}.{part}.{leaf}"] = (self._packed_rows(part), *param.shape[1:])
        return shapes

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are legitimately unused (tied heads, recomputed buffers)."""
        if name.endswith(_IGNORED_SUFFIXES):
            return True
        if self.quantization == "fp8" and name.endswith(_ACTIVATION_SCALE_SUFFIXES):
            return True  # static activation scales: the FP8 GEMMs scale activations per token
        return name == "lm_head.weight" and self.lm_head is None

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (Hugging Face name) into its parameter or packed slice,
        or take a layer's KV-cache scale (`self_attn.k_scale`, `v_scale`, or `kv_scale` for
        both, as vLLM's FP8 checkpoints name them).

        Raises KeyError for a name the model does not have, ValueError for a wrong shape or a
        scale that is not one positive number.
        """
        parent, _, leaf = name.rpartition(".")
        if leaf in _KV_SCALE_NAMES:
            self._load_kv_scale(parent, leaf, tensor)
            return
        module_path, _, proj = parent.rpartition(".")
        if leaf in WEIGHT_SCALE_NAMES:
            linear, rows = self._linear_rows(module_path, proj)
            linear.load_scale_rows(rows, tensor, name)
            return
        if proj in _PACKED:
            fused, _ = _PACKED[proj]
            target = self._parameter(f"{module_path}.{fused}.{leaf}")[self._packed_slice(proj)]
        else:
            target = self._parameter(name)
        if name.endswith(_VOCAB_ROWS) and tensor.shape[0] < target.shape[0]:
            # the last vocabulary shard: its rows past the vocabulary stay zero
            target[tensor.shape[0] :].zero_()
            target = target[: tensor.shape[0]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        if FP8_DTYPE in (target.dtype, tensor.dtype):
            linear, rows = self._linear_rows(module_path, proj)
            linear.load_weight_rows(rows, tensor, name)
            return
        target.copy_(tensor)

    def _packed_slice(self, proj: str) -> slice:
        """The rows of its fused parameter that checkpoint projection `proj` fills."""
        fused, index = _PACKED[proj]
        start = sum(
            self._packed_rows(p) for p, (f, i) in _PACKED.items() if f == fused and i < index
        )
        return slice(start, start + self._packed_rows(proj))

    def _linear_rows(self, module_path: str, proj: str) -> tuple[Linear, slice]:
        """The Linear module checkpoint projection `proj` under `module_path` is (part of), and
        the rows of it that the projection fills."""
        fused = _PACKED[proj][0] if proj in _PACKED else proj
        try:
            module = self.get_submodule(f"{module_path}.{fused}")
        except AttributeError:
            module = None
        if not isinstance(module, Linear):
            raise KeyError(f"{module_path}.{proj}")
        rows = self._packed_slice(proj) if proj in _PACKED else slice(0, module.weight.shape[0])
        return module, rows

    def missing_weight_scales(self) -> list[str]:
        """The FP8 projections some of whose scales no checkpoint tensor gave."""
        return [
            name
            for name, module in self.named_modules()
            if isinstance(module, Linear) and module.missing_scales()
        ]

    def _load_kv_scale(self, attention: str, leaf: str, tensor: torch.Tensor) -> None:
        try:
            module = self.get_submodule(attention) if attention else None
        except AttributeError:
            module = None
        if not isinstance(module, PagedAttention):
            raise KeyError(f"{attention}.{leaf}")
        if tensor.numel() != 1 or not float(tensor.float().item()) > 0:
            raise ValueError(
                f"{attention}.{leaf} must be one positive number, got shape "
                f"{tuple(tensor.shape)}"
                + (f" value {tensor.float().item()}" if tensor.numel() == 1 else "")
            )
        value = float(tensor.float().item())
        k, v = module.checkpoint_kv_scales
        module.checkpoint_kv_scales = KVScales(
            value if leaf in ("k_scale", "kv_scale") else k,
            value if leaf in ("v_scale", "kv_scale") else v,
        )

    def _parameter(self, name: str) -> torch.Tensor:
        try:
            return self.get_parameter(name)
        except AttributeError as exc:
            raise KeyError(name) from exc

    def _packed_rows(self, proj: str) -> int:
        cfg = self.config
        rows = {
            "q_proj": cfg.q_size,
            "k_proj": cfg.kv_size,
            "v_proj": cfg.kv_size,
            "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size,
        }
        return rows[proj]
