"""CUDA graphs of mixed prefill + decode steps, in pieces (`PiecewiseGraphs`).

Run eagerly, a step with a prefill chunk in it launches about 170 Triton kernels and 110 matmuls
on Qwen3-0.6B, and its host side takes 17-30 ms on an H200 machine, where a decode step of the
same sequences replays its graph in 1.4-2.1 ms (docs/benchmarks-archive.md, "mixed prefill +
decode steps in piecewise CUDA graphs"): the device waits
for the host. The step's shape depends on its sequences only through the attention, so the
forward pass is cut at each layer's attention (`model/stages.py`): the dense stages of a padded
row count are captured once, one graph each, and replayed with the attention launched eagerly
between them over the step's own metadata.

The row counts are `piecewise_token_sizes`; a step pads its rows to the next one (padding rows
embed token 0, write no KV, and no attention reads them) and finds its input ids, positions and
slots at the addresses the graphs were captured with (`step_inputs.py`). Steps above the largest
size, and every step on the CPU or under `--enforce-eager`, run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.kernels.graph_timing import gc_paused
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.stages import ForwardStages
from pagekeeper_engine.runner.step_inputs import GraphPadding, StepInputBuilder, StepInputs

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what torch.cuda.graph_pool_handle() returns

# Row counts up to here are captured: at 8,192 rows the device's work on Qwen3-0.6B already
# takes as long as the eager host side, and every size costs start-up time and graph memory.
MAX_PIECEWISE_TOKENS = 8192
_SMALLEST = 16
_SIZES_PER_OCTAVE = 8  # above 512 rows: a step pads by at most an eighth of its rows


def piecewise_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """16, 32, ..., 512, then eight sizes an octave (576, 640, ..., 1024, 1152, ...), up to
    the step token budget (capped at MAX_PIECEWISE_TOKENS) and including it."""
    limit = min(max_num_batched_tokens, MAX_PIECEWISE_TOKENS)
    sizes: set[int] = set()
    size = _SMALLEST
    while size < limit:
        sizes.add(size)
        size = size * 2 if size < 512 else size + _octave_step(size)
    if limit >= _SMALLEST:
        sizes.add(limit)
    return sorted(sizes)


def _octave_step(size: int) -> int:
    octave = 1 << (size.bit_length() - 1)  # the power of two at or below size
    return octave // _SIZES_PER_OCTAVE


class PiecewiseGraphs:
    """The dense stages of each captured row count, one CUDA graph each, and their replay."""

    def __init__(self, model: CausalLM, builder: StepInputBuilder, token_sizes: Sequence[int]):
        self.model = model
        self.builder = builder
        self.token_sizes = sorted(token_sizes)
        self._pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], ForwardStages]] = {}

    @property
    def num_graphs(self) -> int:
        return sum(len(graphs) for graphs, _ in self._pieces.values())

    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE) -> None:
        """Record each size's dense stages into `pool`, largest size first (the KV cache must
        be bound). The capture's inputs are padding rows only: no KV slot is written."""
        for rows in reversed(self.token_sizes):
            step = self.builder.build([], GraphPadding(rows, decode=False))
            stages = self.model.stages(step.input_ids, step.positions, step.meta)
            stages.run(step.meta)  # compiles this row count's kernels; no sequence to attend
            torch.cuda.synchronize(self.builder.device)
            graphs = []
            for dense in stages.dense:
                graph = torch.cuda.CUDAGraph()
                with gc_paused(), torch.cuda.graph(graph, pool=pool):
                    dense()
                graphs.append(graph)
            self._pieces[rows] = (graphs, stages)
        for rows, (graphs, _) in self._pieces.items():
            # The first replay uploads each graph to the device: pay it here, not in a step.
            self.builder.build([], GraphPadding(rows, decode=False))
            for graph in graphs:
                graph.replay()

    def padding_for(self, seqs: Sequence[ScheduledSeq]) -> GraphPadding | None:
        """The captured row count to pad a step to; None runs it eagerly."""
        if not self._pieces:
            return None
        total = sum(s.num_tokens for s in seqs)
        for rows in self.token_sizes:
            if rows >= total:
                return GraphPadding(rows, decode=False)
        return None

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states (rows, H) of a step padded by `padding_for`: each dense stage replayed,
        each layer's attention launched over the step's metadata in between."""
        assert step.padding is not None and not step.padding.decode
        graphs, stages = self._pieces[step.padding.rows]
        assert step.input_ids.data_ptr() == stages.input_ids.data_ptr(), (
            "a padded step's inputs are not where its graphs read them"
        )
        graphs[0].replay()
        for attend, graph in zip(stages.attention, graphs[1:], strict=True):
            attend(step.meta)
            graph.replay()
        return stages.hidden
