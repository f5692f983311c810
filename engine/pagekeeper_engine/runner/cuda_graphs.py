"""A step's CUDA graphs (`StepGraphs`), replayed over the step-input buffers.

Decode-only batches of the captured sizes replay the whole forward pass from one graph; steps
with a prefill chunk replay it in pieces around an eager attention (`piecewise_graphs.py`). All
are recorded once after the KV cache is bound, in one private memory pool, largest first so the
smaller graphs reuse its memory. The inputs are `step_inputs.StepInputBuilder`'s static
buffers and the activations the model's workspace, so a replay reads and writes the addresses
it was captured with. A decode graph's padding rows write no KV (slot -1) and attend to one
token of block 0, which the block pool never hands out. Without tensor parallelism a decode graph
also runs the LM head over all its rows into the sampler's logits (`replayed_logits`): a decode
step samples every sequence, and at small batches the head's launch from the host costs more
than its padding rows cost the device.
The decode kernel's split count is fixed at capture by `choose_num_splits` at `max_model_len`;
the kernel derives each split's range from the sequence's own length, so the graph is valid at
any length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.kernels.graph_timing import gc_paused
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.runner.piecewise_graphs import PiecewiseGraphs
from pagekeeper_engine.runner.step_inputs import GraphPadding, StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs, and max_num_seqs itself: a
    batch pads by at most 15 rows beyond 8."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def decode_forward(
    model: CausalLM, builder: StepInputBuilder, batch: int, seqs: Sequence[ScheduledSeq] = ()
) -> tuple[Callable[[], torch.Tensor], StepInputs]:
    """A decode forward of `seqs` padded to `batch` rows over the builder's buffers (padding
    rows write no KV), with the decode kernel's splits chosen for the longest sequence a graph
    may meet, as a captured graph's are; and the step it reads."""
    step = builder.build(seqs, GraphPadding(batch, decode=True))
    meta = replace(step.meta, max_seq_len=builder.max_model_len)
    return (lambda: model(step.input_ids, step.positions, meta)), step


class StepGraphs:
    """Captured decode forwards, one per batch size, and the piecewise graphs of mixed steps,
    one set per row count; `padding_for` says which one a step takes."""

    def __init__(
        self,
        model: CausalLM,
        builder: StepInputBuilder,
        batch_sizes: Sequence[int],
        token_sizes: Sequence[int] = (),
        logits_out: torch.Tensor | None = None,
    ):
        """`logits_out`: (>= max batch, V) in the model's dtype, where each decode graph writes
        its rows' logits; None leaves the LM head out of the graphs (as under tensor
        parallelism, whose logits gather to rank 0 alone)."""
        assert logits_out is None or logits_out.shape[0] >= max(batch_sizes, default=0), (
            f"logits_out holds {logits_out.shape[0]} rows, below the largest graph batch"
        )
        self.model = model
        self.builder = builder
        self.batch_sizes = sorted(batch_sizes)
        self.logits_out = logits_out
        # batch -> (graph, the hidden states it leaves, the input ids it reads)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.piecewise = PiecewiseGraphs(model, builder, token_sizes)
        self.pool_bytes = 0
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every graph; the model's KV cache must be bound. The cyclic garbage
        collector is paused throughout (`gc_paused`: a collection inside a capture can
        invalidate it)."""
        with gc_paused():
            self._capture()

    def _capture(self) -> None:
        started = time.perf_counter()
        device = self.builder.device
        torch.cuda.empty_cache()  # so the reserved bytes below count the graphs' pool alone
        reserved_before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()  # one private pool, shared by every graph
        for batch in reversed(self.batch_sizes):
            forward, step = decode_forward(self.model, self.builder, batch)
            forward()  # compiles this shape's kernels
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward()  # (batch, H)
                if self.logits_out is not None:
                    self.model.compute_logits(hidden, self.logits_out)  # (batch, V)
            self._graphs[batch] = (graph, hidden, step.input_ids)
        for batch, (graph, _, _) in self._graphs.items():
            # The first replay uploads the graph to the device: pay it here, not in a step. The
            # padding inputs are rebuilt first, so no KV slot is written.
            self.builder.build([], GraphPadding(batch, decode=True))
            graph.replay()
        self.piecewise.capture(pool)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up runs' cached blocks; the private pool stays
        # The private pool's memory, held for as long as the graphs live.
        self.pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured %d decode graphs (batch %d..%d) and %d piecewise graphs of mixed steps "
            "(%d sizes, %d..%d tokens) in %.1f s, %.1f MiB held",
            len(self._graphs),
            self.batch_sizes[0],
            self.batch_sizes[-1],
            self.piecewise.num_graphs,
            len(self.piecewise.token_sizes),
            self.piecewise.token_sizes[0] if self.piecewise.token_sizes else 0,
            self.piecewise.token_sizes[-1] if self.piecewise.token_sizes else 0,
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )

    def padding_for(self, seqs: Sequence[ScheduledSeq]) -> GraphPadding | None:
        """The captured shape to pad a step to; None runs the step eagerly."""
        if self._graphs and all(s.num_tokens == 1 for s in seqs):
            for batch in self.batch_sizes:
                if batch >= len(seqs):
                    return GraphPadding(batch, decode=True)
            return None
        return self.piecewise.padding_for(seqs)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states (rows, H) of the step: replayed when it was padded for a graph."""
        if step.padding is None:
            hidden: torch.Tensor = self.model(step.input_ids, step.positions, step.meta)
            return hidden
        if not step.padding.decode:
            return self.piecewise.forward(step)
        graph, hidden, input_ids = self._graphs[step.padding.rows]
        assert step.input_ids.data_ptr() == input_ids.data_ptr(), (
            "a padded step's inputs are not where its graph reads them"
        )
        graph.replay()
        return hidden

    def replayed_logits(self, step: StepInputs) -> torch.Tensor | None:
        """The logits (rows, V) of every row of `step`, its sequences' first, when the step
        replayed a decode graph that ran the LM head; else None."""
        if self.logits_out is None or step.padding is None or not step.padding.decode:
            return None
        return self.logits_out[: step.padding.rows]
