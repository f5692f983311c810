"""The runner's timed kernel choices at start-up: which batch-1 projections run the Triton GEMV
and whether a one-token layer runs fused (`model/gemv_choice.py` times them).

They are made before the memory profile, over a scratch cache of a few blocks, so the profile
steps and captures the kernels serving runs, and so what the timing leaves allocated (cuBLAS's
workspaces, 32 MiB a stream on Hopper) is measured as the steps' memory rather than found
beside the budget once serving (docs/benchmarks-archive.md, "what the start-up choices left
outside the budget").

The timed forward decodes one sequence at a context of `TIMING_CONTEXT` tokens, not a padding
row over one: a kernel that loads its weights before waiting for the one ahead gains by as much
as the attention ahead of it takes, and an attention over one token takes too little to show
it (the archive's "whole-row GEMV tiles": tied at one token, they served the 0.6B 57 us a token
faster).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.kernels import supports_pdl
from pagekeeper_engine.model.gemv_choice import (
    FusionChoice,
    GemvChoice,
    choose_gemv,
    choose_row_fusion,
)
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.runner.cuda_graphs import decode_forward
from pagekeeper_engine.runner.profile_target import RunnerProfileTarget
from pagekeeper_engine.runner.step_inputs import StepInputBuilder, StepInputs

TIMING_CONTEXT = 256  # tokens: the ITL benchmark's contexts are 128-384


@dataclass(frozen=True)
class KernelChoices:
    """What was chosen, and the bytes the timing left allocated (0 off a GPU)."""

    gemv: list[GemvChoice] = field(default_factory=list)
    fusion: FusionChoice | None = None
    kept_bytes: int = 0


def choose_kernels(
    model: CausalLM,
    inputs: StepInputBuilder,
    tp: TensorParallelGroup,
    target: RunnerProfileTarget,
    device: torch.device,
) -> KernelChoices:
    """Time and set the batch-1 choices on `model` (on a GPU; nothing elsewhere). Each rank
    times its own shard's compute; under tensor parallelism the layer stays unfused (its
    partial sums need the all-reduce before the residual add). The timing's freed memory stays
    cached: the caller releases it before the profile reads the allocator."""
    if device.type != "cuda":
        return KernelChoices()
    allocated_before = torch.cuda.memory_allocated(device)
    context = min(TIMING_CONTEXT, inputs.max_model_len)
    target.bind_scratch_cache(-(-context // inputs.block_size))
    fusion = None
    try:
        forward, _ = context_forward(model, inputs, context)
        with tp.local_only():
            gemv = choose_gemv(model, forward)
        if not tp.is_active:
            fusion = choose_row_fusion(model, model.set_row_fusion, forward, supports_pdl(device))
    finally:
        target.release_scratch_cache()
    return KernelChoices(gemv, fusion, torch.cuda.memory_allocated(device) - allocated_before)


def context_forward(
    model: CausalLM, builder: StepInputBuilder, context: int
) -> tuple[Callable[[], torch.Tensor], StepInputs]:
    """A batch-1 decode forward of one sequence at `context` tokens (`decode_forward`), over a
    bound cache of at least ceil(context / block size) blocks (it writes the newest token's KV
    at position context - 1); and the step it reads."""
    num_blocks = -(-context // builder.block_size)
    timed = ScheduledSeq(
        "kernel-choice", [0], context - 1, list(range(num_blocks)), False, SamplingParams(), 0
    )
    return decode_forward(model, builder, 1, [timed])
