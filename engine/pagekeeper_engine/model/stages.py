"""A forward pass cut at each layer's attention (`ForwardStages`).

Everything in a decoder layer but the attention itself works row by row: norms, projections,
the rotary embedding, the KV write (at each row's slot), the residual adds and the MLP. Only the
attention reads the step's sequences (query offsets, lengths, block tables), which change from
step to step. So the forward pass of T rows is L + 1 *dense* stages, whose work depends only on
T and the per-row inputs, with L *attention* stages between them:

    dense[0]   embedding; layer 0 up to its KV write
    attention[0]
    dense[i]   layer i-1 from its output projection on; layer i up to its KV write
    attention[i]
    dense[L]   layer L-1 from its output projection on; the final norm

Each stage is bound to its rows of the workspace when it is made. A caller may capture the dense
stages of a padded token count in CUDA graphs once and run the attention stages eagerly over
each step's metadata between their replays (`runner/piecewise_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagekeeper_engine.attention.base import AttentionMetadata


@dataclass(frozen=True)
class ForwardStages:
    """The stages of one forward pass over a fixed number of rows."""

    dense: Sequence[Callable[[], None]]  # L + 1
    attention: Sequence[Callable[[AttentionMetadata], None]]  # L
    hidden: torch.Tensor  # (T, H): where the last dense stage leaves the hidden states
    input_ids: torch.Tensor  # (T,): what the first dense stage embeds

    def __post_init__(self) -> None:
        assert len(self.dense) == len(self.attention) + 1, "one dense stage around each attention"

    def run(self, meta: AttentionMetadata) -> torch.Tensor:
        """The whole forward pass, eagerly, with `meta` for every attention: `hidden`."""
        self.dense[0]()
        for attend, dense in zip(self.attention, self.dense[1:], strict=True):
            attend(meta)
            dense()
        return self.hidden
