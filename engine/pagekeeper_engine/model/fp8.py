"""FP8 (e4m3) weights for the linear projections: quantizing at load, the checkpoint's own FP8
form, and the matrix products over them.

A projection's weight W (N, K) is stored as W_q = round_e4m3(W / s) with one fp32 scale per
output row, s[n] = max_k |W[n, k]| / 448 (e4m3's largest finite value), so every row uses the
whole FP8 range and W ~= W_q * s[:, None]. Only q/k/v/o and gate/up/down are quantized: they
are ~all of a decoder's weight bytes; the embedding is a gather (no product to speed up), the
norms are vectors, and the LM head's logits feed sampling directly, where an FP8 error is a
changed token rather than a perturbed hidden state.

The products, by where they run:

- a CUDA GPU with FP8 (compute capability 8.9+), more than one row or no Triton GEMV chosen:
  each row of x is quantized with its own dynamic scale, t[m] = max_k |x[m, k]| / 448, and
  `torch._scaled_mm` computes (x_q W_q^T) * t[:, None] * s[None, :] in one FP8 GEMM with bf16
  output;
- one row with the Triton GEMV chosen (`kernels/gemv.py`): x stays bf16, W_q is read as e4m3
  and the scale is applied in the epilogue: half the bytes of a bf16 GEMV;
- the CPU: the weight-only reference, x (W_q * s)^T in x's dtype. It is what the GEMV computes
  and what the CPU tests run through the real loader.

Checkpoints: a bf16/fp16/fp32 tensor loaded into an FP8 projection is quantized row by row
(under tensor parallelism, each rank's slice: a row-parallel projection's rows are quantized
over this rank's columns only). An FP8 checkpoint (`quantization_config.quant_method: fp8`, as
vLLM's and llm-compressor's tools write it) gives the e4m3 weight and its `weight_scale` (or
`weight_scale_inv`, which multiplies the same way), per tensor or per output row; a per-tensor
scale is spread over the rows it covers. Its `input_scale` (static activation scales) is unused:
the GEMM's activation scales are dynamic. Block-wise scales are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagekeeper_engine.flags import QUANTIZATIONS
from pagekeeper_engine.model.hf_config import read_json

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# Floor of a scale: an all-zero row (or token) quantizes to zeros instead of 0 / 0.
MIN_SCALE = 1e-12
WEIGHT_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# GEMMs on FP8 tensor cores need K and N in multiples of 16 (cuBLASLt's FP8 layout rule).
SCALED_MM_ALIGNMENT = 16


class QuantizationError(ValueError):
    """A quantization the checkpoint, the device or the dtype cannot run; the message names the
    flag or the checkpoint field."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> ((N, K) e4m3, (N,) fp32 scales) with weight ~= q * scales[:, None]."""
    w32 = weight.float()
    scales = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = (w32 / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scales


def dequantize_rows(
    quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(N, K) e4m3 and (N,) fp32 scales -> (N, K) in `dtype`."""
    return (quantized.float() * scales[:, None]).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> ((M, K) e4m3, (M, 1) fp32): one dynamic scale per row of activations."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight-only reference: x (W_q * s)^T (+ b) in x's dtype, into `out` when given."""
    result = torch.nn.functional.linear(x, dequantize_rows(weight, scales, x.dtype), bias)
    return result if out is None else out.copy_(result)


def scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: (M, K) bf16 -> (M, N) bf16 through one FP8 GEMM with per-token and per-channel
    scales (both fp32, applied to the GEMM's fp32 accumulator)."""
    x_q, x_scales = _token_quantizer(x.is_cuda)(x)
    w_t = weight.t()  # (K, N), column-major: the layout the FP8 GEMM takes for its 2nd operand
    w_scales = scales.view(1, -1)
    # The bias is added after the GEMM: not every torch build's row-wise scaled GEMM takes one.
    if out is None or not out.is_contiguous():
        result = torch._scaled_mm(x_q, w_t, scale_a=x_scales, scale_b=w_scales, out_dtype=x.dtype)
        result = result if out is None else out.copy_(result)
    else:
        result = torch._scaled_mm(
            x_q, w_t, scale_a=x_scales, scale_b=w_scales, out_dtype=x.dtype, out=out
        )
    return result if bias is None else result.add_(bias)


def _token_quantizer(is_cuda: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The Triton per-token quantization on CUDA (one launch, no fp32 copy of x); torch's
    elsewhere. Imported on first CUDA use: a kernel module fixes the interpreter mode."""
    if not is_cuda:
        return quantize_tokens
    from pagekeeper_engine.kernels import fp8_quant  # noqa: PLC0415 (imports triton)

    return fp8_quant.quantize_tokens


def checkpoint_quantization(config_json: dict[str, Any]) -> str | None:
    """ "fp8" for a checkpoint whose config.json says its weights are FP8, None for none;
    QuantizationError for a form the engine does not load."""
    quant = config_json.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError("config.json: quantization_config must be an object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(the engine loads quant_method 'fp8' with per-tensor or per-channel scales)"
        )
    if quant.get("weight_block_size") is not None:
        raise QuantizationError(
            f"config.json: quantization_config.weight_block_size {quant['weight_block_size']} "
            "(block-wise FP8 scales) is not supported; per-tensor or per-channel scales are"
        )
    return "fp8"


def resolve_quantization(
    requested: str | None,
    from_checkpoint: str | None,
    dtype: torch.dtype,
    device: torch.device,
) -> str:
    """The weights' quantization: as asked, else the checkpoint's, else none; refused where it
    cannot run (QuantizationError naming the flag)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {requested!r} is not one of {QUANTIZATIONS}")
    if requested == "none" and from_checkpoint == "fp8":
        raise QuantizationError(
            "--quantization none: the checkpoint's weights are FP8 (config.json "
            "quantization_config); leave --quantization unset or give fp8"
        )
    chosen = requested or from_checkpoint or "none"
    if chosen == "none" or device.type == "cpu":
        return chosen  # the CPU runs FP8 weights through the weight-only reference
    if device.type != "cuda":
        raise QuantizationError(f"--quantization fp8 does not run on {device.type}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise QuantizationError(
            f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    if dtype != torch.bfloat16:
        raise QuantizationError(
            f"--quantization fp8 computes in bfloat16 (its GEMMs' output type); --dtype gives "
            f"{dtype}: use --dtype bfloat16 or auto"
        )
    return chosen


def weight_quantization(
    requested: str | None, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> str:
    """`resolve_quantization` for the checkpoint in `model_dir`, logged."""
    from_checkpoint = checkpoint_quantization(read_json(model_dir / "config.json"))
    chosen = resolve_quantization(requested, from_checkpoint, dtype, device)
    if chosen == "fp8":
        source = "FP8 checkpoint" if from_checkpoint == "fp8" else "quantized at load"
        path = "FP8 GEMMs" if device.type == "cuda" else "the dequantizing reference (CPU)"
        logger.info("FP8 weights for the linear projections (%s), through %s", source, path)
    return chosen


def spread_scale(scale: torch.Tensor, num_rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale as (num_rows,) fp32: one per tensor spread over its rows, or
    one per row; ValueError for another shape (block-wise scales)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(num_rows)
    if scale.numel() == num_rows and scale.dim() <= 2 and scale.shape[0] == num_rows:
        return scale.float().reshape(num_rows)
    raise ValueError(
        f"tensor {name!r} has shape {tuple(scale.shape)}: a weight scale is one number or one "
        f"per output row ({num_rows})"
    )


def is_weight_scale(name: str) -> bool:
    return name.rpartition(".")[2] in WEIGHT_SCALE_NAMES
