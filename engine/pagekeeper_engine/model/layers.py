"""Building blocks of the Llama-family decoder: linear layers, RMSNorm, rotary embedding, SwiGLU
(the attention is `paged_attention.py`).

Parameters are created with `torch.empty` (no init kernels): the loader fills every one of them,
from a checkpoint or from the dummy generator. Projections that read the same input are fused
(q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so each is one matmul; the loader packs the
checkpoint's separate tensors into their row slices.

On CUDA the elementwise steps run as fused Triton kernels (`kernels/rms_norm.py`, `rotary.py`,
`swiglu.py`: one launch each instead of 3-24 torch ops), and with the Triton attention backend
the rotary embedding (and Qwen3's q/k norm) is applied inside its KV-write kernel; on the CPU
the torch code below is the reference they are tested against.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional

from pagekeeper_engine.model import fp8
from pagekeeper_engine.model.fp8 import FP8_DTYPE, SCALED_MM_ALIGNMENT
from pagekeeper_engine.model.hf_config import RopeScaling
from pagekeeper_engine.model.workspace import Workspace

if TYPE_CHECKING:
    from pagekeeper_engine.kernels.gemv import GemvConfig


@functools.cache
def _kernel(name: str) -> ModuleType:
    """The Triton kernel module `name`, imported on first CUDA use: a kernel module fixes
    interpreted or native mode (`TRITON_INTERPRET`) when it is imported."""
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"pagekeeper_engine.kernels.{name}")


class Linear(nn.Module):
    """y = x W^T (+ b), W of shape (out_features, in_features); no init, no autograd.

    A single row goes through the Triton GEMV when `gemv_config` is set (the runner decides
    per shape at start-up, `model/gemv_choice.py`); everything else through cuBLAS.

    With `quantization="fp8"` W is e4m3 with one fp32 scale per output row in `weight_scale`
    (a buffer: a bf16 checkpoint has no such tensor), and the products are `model/fp8.py`'s.
    The scales start as NaN, so a scale the loader never wrote is caught (`missing_scales`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        quantization: str = "none",
    ):
        super().__init__()
        self.weight_scale: torch.Tensor | None
        if quantization == "fp8":
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=FP8_DTYPE), False
            )
            self.register_buffer(
                "weight_scale", torch.full((out_features,), math.nan, dtype=torch.float32)
            )
            # cuBLASLt's FP8 layout rule; other shapes (tiny test models) take the reference.
            self.uses_scaled_mm = (
                in_features % SCALED_MM_ALIGNMENT == 0 and out_features % SCALED_MM_ALIGNMENT == 0
            )
        else:
            assert quantization == "none", f"unknown quantization {quantization!r}"
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
            self.weight_scale = None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        self.gemv_config: GemvConfig | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, in) -> (T, out_features), into `out` when given."""
        if self.gemv_config is not None and x.shape[0] == 1:
            result: torch.Tensor = _kernel("gemv").gemv(
                x,
                self.weight,
                self.bias,
                out=out,
                config=self.gemv_config,
                weight_scale=self.weight_scale,
            )
            return result
        if self.weight_scale is not None:
            if x.is_cuda and self.uses_scaled_mm:
                return fp8.scaled_mm_linear(x, self.weight, self.weight_scale, self.bias, out)
            return fp8.reference_linear(x, self.weight, self.weight_scale, self.bias, out)
        if out is None:
            return functional.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def load_weight_rows(self, rows: slice, tensor: torch.Tensor, name: str) -> None:
        """Rows `rows` of an FP8 weight from checkpoint tensor `name`: e4m3 as it is (its
        scales come in their own tensor), or a wider dtype quantized row by row."""
        if self.weight_scale is None:
            raise ValueError(
                f"tensor {name!r} is FP8 but the model's weights are {self.weight.dtype} "
                "(--quantization none?)"
            )
        if tensor.dtype == FP8_DTYPE:
            self.weight[rows].copy_(tensor)
            return
        quantized, scales = fp8.quantize_rows(tensor)
        self.weight[rows].copy_(quantized)
        self.weight_scale[rows].copy_(scales)

    def load_scale_rows(self, rows: slice, tensor: torch.Tensor, name: str) -> None:
        """Rows `rows` of `weight_scale` from an FP8 checkpoint's scale tensor `name` (one for
        the whole tensor, or one per output row)."""
        if self.weight_scale is None:
            raise ValueError(
                f"tensor {name!r} scales FP8 weights but the model's weights are "
                f"{self.weight.dtype} (--quantization none?)"
            )
        num_rows = rows.stop - rows.start
        self.weight_scale[rows].copy_(fp8.spread_scale(tensor, num_rows, name))

    def missing_scales(self) -> bool:
        """An FP8 weight some of whose rows' scales were never loaded."""
        return self.weight_scale is not None and bool(self.weight_scale.isnan().any())


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, optionally fused with a residual add."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32; the normalised value is rounded to the input dtype before the
        # weight multiply, which is what the reference implementation does in bf16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, dim) or (T, heads, dim) -> same shape, into `out` when given (may be x)."""
        if not x.is_cuda:
            normed = self._norm(x)
            return normed if out is None else out.copy_(normed)
        result: torch.Tensor
        result, _ = _kernel("rms_norm").rms_norm(x, self.weight, self.eps, out=out)
        return result

    def forward_residual_(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """x, residual: (T, dim), in place: residual becomes x + residual (the new residual
        stream), x becomes its norm."""
        if x.is_cuda:
            _kernel("rms_norm").rms_norm(x, self.weight, self.eps, residual, out=x, summed=residual)
            return
        residual.add_(x)
        x.copy_(self._norm(residual))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim // 2,) fp32 rotary frequencies, stretched as the checkpoint's scaling says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by
    # `factor`, shorter than context / high_freq_factor kept, and the band between blended
    # linearly in (context / wavelength).
    wavelen = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    blend = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blend = blend.clamp(0.0, 1.0)
    return (1.0 - blend) * inv_freq / scaling.factor + blend * inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) from a cos/sin table indexed by position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # (max_position, head_dim // 2) each, fp32: angles are computed once, never in bf16.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (T, num_heads, head_dim), positions: (T,) -> rotated x, same shape and dtype."""
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, head_dim // 2)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)

    def forward_qk(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). On CUDA one kernel rotates both in place (q and k may be views of
        the qkv projection's output: v, beside them, is not touched)."""
        if not q.is_cuda:
            return self(positions, q), self(positions, k)
        _kernel("rotary").apply_rotary_(q, k, positions, self.cos, self.sin)
        return q, k


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one (2I, H) matrix.

    Under tensor parallelism `intermediate_size` is this rank's columns and `out` receives the
    down projection's partial sums, which the decoder layer adds up over the ranks."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        quantization: str = "none",
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, quantization=quantization
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=False, dtype=dtype, quantization=quantization
        )

    def forward(self, x: torch.Tensor, workspace: Workspace, out: torch.Tensor) -> None:
        """x: (T, H) -> out (T, H), which may be x: the MLP runs over chunks of the workspace's
        `mlp_chunk` rows, and a chunk's rows of x are read before its rows of out are written."""
        num_tokens = x.shape[0]
        for start in range(0, num_tokens, workspace.mlp_chunk):
            end = min(start + workspace.mlp_chunk, num_tokens)
            gate_up = self.gate_up_proj(x[start:end], out=workspace.rows("gate_up", end - start))
            activated = workspace.rows("act", end - start)  # (C, I)
            if gate_up.is_cuda:
                _kernel("swiglu").swiglu(gate_up, out=activated)
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                torch.mul(functional.silu(gate), up, out=activated)
            self.down_proj(activated, out=out[start:end])
