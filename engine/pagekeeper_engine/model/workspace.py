"""Preallocated activation buffers: the forward pass's memory has one static shape.

Every temporary of a decoder layer that scales with the step's tokens lives in a buffer
allocated once, at the engine's token budget, and each step works in the leading rows of them:

- `residual` and `hidden` (T, H): the residual stream and the normed / projected stream. The
  fused RMSNorm + residual kernel updates both in place, and the o and down projections write
  their output back into `hidden`.
- `qkv` (T, q + 2 kv): the fused projection; q and k are normed and rotated in place there.
- `attn` (T, q): the attention output, read by the o projection.
- `gate_up` (C, 2I) and `act` (C, I): the MLP runs over the step in chunks of C tokens, so its
  widest temporaries never scale with the token budget beyond C.
- `statistics` (2L + 1, H) fp32: the one-token layer's partial sums of squares of the residual
  stream, a row for each norm, written by the projection before it (`model/row_fusion.py`).

A step then leaves nothing of its own size in the caching allocator: what it allocates beyond
these (logits and the sampler's rows, the decode kernel's split partials) scales with the
sequences sampled, not with the tokens. That keeps allocator fragmentation (reserved -
allocated) near zero over days of varying shapes, and a captured CUDA graph reads and writes the
same addresses as an eager step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekeeper_engine.model.hf_config import ModelConfig

# Tokens per MLP chunk: a (C, H) x (H, 2I) matmul at C = 8192 runs at the GPU's full matmul rate,
# and its (C, 2I) output is a few hundred MiB at 8B shapes instead of gigabytes at 64k tokens.
MLP_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class WorkspaceShape:
    """The widths of each buffer and the rows they hold."""

    max_tokens: int
    num_layers: int
    hidden_size: int
    q_size: int
    kv_size: int
    intermediate_size: int
    mlp_chunk: int

    @classmethod
    def for_model(
        cls, config: ModelConfig, max_tokens: int, mlp_chunk: int = MLP_CHUNK_TOKENS
    ) -> WorkspaceShape:
        if max_tokens < 1:
            raise ValueError(f"a workspace holds at least one token, got {max_tokens}")
        return cls(
            max_tokens=max_tokens,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            q_size=config.q_size,
            kv_size=config.kv_size,
            intermediate_size=config.intermediate_size,
            mlp_chunk=min(mlp_chunk, max_tokens),
        )

    @property
    def num_statistics(self) -> int:
        """fp32 entries of the one-token layer's partial sums of squares: a row of up to H for
        each norm it writes."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def num_elements(self) -> int:
        rows = self.max_tokens * (2 * self.hidden_size + self.q_size + 2 * self.kv_size)
        rows += self.max_tokens * self.q_size
        return rows + self.mlp_chunk * 3 * self.intermediate_size


class Workspace:
    """The buffers of `WorkspaceShape`, and views of their leading rows for one step."""

    def __init__(self, shape: WorkspaceShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        s = shape
        # One allocation: a single segment that no other tensor can split.
        self._flat = torch.empty(s.num_elements, dtype=dtype, device=device)
        widths = {
            "residual": (s.max_tokens, s.hidden_size),
            "hidden": (s.max_tokens, s.hidden_size),
            "qkv": (s.max_tokens, s.q_size + 2 * s.kv_size),
            "attn": (s.max_tokens, s.q_size),
            "gate_up": (s.mlp_chunk, 2 * s.intermediate_size),
            "act": (s.mlp_chunk, s.intermediate_size),
        }
        self._buffers: dict[str, torch.Tensor] = {}
        start = 0
        for name, (rows, width) in widths.items():
            self._buffers[name] = self._flat[start : start + rows * width].view(rows, width)
            start += rows * width
        assert start == s.num_elements, "buffer layout and element count disagree"
        self.statistics = torch.zeros(
            (2 * s.num_layers + 1, s.hidden_size), dtype=torch.float32, device=device
        )

    @property
    def nbytes(self) -> int:
        return self._flat.nbytes + self.statistics.nbytes

    @property
    def max_tokens(self) -> int:
        return self.shape.max_tokens

    @property
    def mlp_chunk(self) -> int:
        return self.shape.mlp_chunk

    def rows(self, name: str, num_tokens: int) -> torch.Tensor:
        """The leading `num_tokens` rows of buffer `name` (contiguous)."""
        buffer = self._buffers[name]
        if num_tokens > buffer.shape[0]:
            raise ValueError(
                f"a step of {num_tokens} tokens does not fit the {name!r} workspace "
                f"({buffer.shape[0]} rows)"
            )
        return buffer[:num_tokens]
