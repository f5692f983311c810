"""A step as rank 0 hands it to the other tensor-parallel ranks (`FollowerStep`).

Rank 0 alone turns the scheduler's sequences into a step's inputs; the others need only those
inputs as bytes (`step_inputs.PackedInputs`), what the sampled rows pick with, and the KV swaps
to apply first. `executor/protocol.py` carries it as MessagePack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekeeper_engine.core.kv_copies import CopyFence
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.runner.step_inputs import PackedInputs, StepInputs


@dataclass(frozen=True)
class FollowerStep:
    """One step for a rank > 0: `inputs` None for a step of swaps alone."""

    inputs: PackedInputs | None
    num_seqs: int
    # The sampled rows, in order: their requests (whose next inputs gather these rows' ids),
    # sampling parameters and output tokens so far (the seeded rows' draws).
    request_ids: list[str] = field(default_factory=list)
    sampling: list[SamplingParams] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # the host KV tier's copies and fence (`core.kv_copies`): each rank copies its shard
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_fence: CopyFence = CopyFence.NONE
    kv_late_loads: list[tuple[int, int]] = field(default_factory=list)


def follower_step(out: SchedulerOutput, inputs: StepInputs | None) -> FollowerStep:
    """`out` as the other ranks run it: `inputs` as rank 0 prepared them of `out.seqs` with
    their bytes kept (None: no sequences)."""
    if inputs is None:
        return FollowerStep(
            None,
            0,
            blocks_to_swap_out=out.blocks_to_swap_out,
            blocks_to_swap_in=out.blocks_to_swap_in,
            kv_loads=out.kv_loads,
            kv_stores=out.kv_stores,
            kv_fence=out.kv_fence,
            kv_late_loads=out.kv_late_loads,
        )
    assert inputs.packed is not None, "the step's inputs were prepared without their bytes"
    picked = [out.seqs[i] for i in inputs.sampled_seqs]
    return FollowerStep(
        inputs=inputs.packed,
        num_seqs=len(out.seqs),
        request_ids=[s.request_id for s in picked],
        sampling=[s.sampling for s in picked],
        num_output_tokens=[s.num_output_tokens for s in picked],
        blocks_to_swap_out=out.blocks_to_swap_out,
        blocks_to_swap_in=out.blocks_to_swap_in,
        kv_loads=out.kv_loads,
        kv_stores=out.kv_stores,
        kv_fence=out.kv_fence,
        kv_late_loads=out.kv_late_loads,
    )
