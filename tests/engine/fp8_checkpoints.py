"""Tiny FP8 checkpoints for the tests: a Hugging Face model's projections quantized to e4m3 with
their scales (per output row or per tensor) as FP8 checkpoints store them, and the model whose
projections are those weights dequantized, to compare against."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from pagekeeper_engine.model.fp8 import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows
from tests.engine.checkpoints import make_hf_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def dequantized_copy(model: PreTrainedModel, per_tensor: bool = False) -> PreTrainedModel:
    """`model` with every projection's weight replaced by its FP8 round trip."""
    copy = make_hf_model(model.config.model_type)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            if is_projection(name):
                param.copy_(round_trip(param, per_tensor))
    return copy


def round_trip(weight: torch.Tensor, per_tensor: bool) -> torch.Tensor:
    quantized, scales = quantize(weight, per_tensor)
    return dequantize_rows(quantized, scales.expand(weight.shape[0]), weight.dtype)


def quantize(weight: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not per_tensor:
        return quantize_rows(weight)
    scale = weight.abs().max().float() / FP8_MAX
    return (weight.float() / scale).to(FP8_DTYPE), scale.reshape(1)


def write_fp8_checkpoint(
    path: Path, model: PreTrainedModel, *, per_tensor: bool, scale_name: str = "weight_scale"
) -> None:
    """`model` as an FP8 checkpoint: e4m3 projection weights, their scales, static input
    scales (unused by the engine), and config.json's quantization_config."""
    model.save_pretrained(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if is_projection(name):
            quantized, scales = quantize(tensor, per_tensor)
            stem = name.removesuffix(".weight")
            tensors[name] = quantized
            tensors[f"{stem}.{scale_name}"] = scales if per_tensor else scales[:, None]
            tensors[f"{stem}.input_scale"] = torch.tensor(1.0)
        else:
            tensors[name] = tensor.contiguous()
    for old in path.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (path / "config.json").write_text(json.dumps(config))
