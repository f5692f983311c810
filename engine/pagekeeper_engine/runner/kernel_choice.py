"""The runner's timed kernel choices at start-up: which batch-1 projections run the Triton GEMV
and whether a one-token layer runs fused (`model/gemv_choice.py` times them).

They are made before the memory profile, over a one-block scratch cache (a padding row reads
block 0 alone), so the profile steps and captures the kernels serving runs, and so what the
timing leaves allocated (cuBLAS's workspaces, 32 MiB a stream on Hopper) is measured as the
steps' memory rather than found beside the budget once serving (docs/benchmarks.md, run 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.kernels import supports_pdl
from pagekeeper_engine.model.gemv_choice import (
    FusionChoice,
    GemvChoice,
    choose_gemv,
    choose_row_fusion,
)
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.runner.cuda_graphs import padding_forward
from pagekeeper_engine.runner.profile_target import RunnerProfileTarget
from pagekeeper_engine.runner.step_inputs import StepInputBuilder


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
    target.bind_scratch_cache(1)
    fusion = None
    try:
        forward, _ = padding_forward(model, inputs, batch=1)
        with tp.local_only():
            gemv = choose_gemv(model, forward)
        if not tp.is_active:
            fusion = choose_row_fusion(model.set_row_fusion, forward, supports_pdl(device))
    finally:
        target.release_scratch_cache()
    return KernelChoices(gemv, fusion, torch.cuda.memory_allocated(device) - allocated_before)
