"""Data objects that cross the scheduler -> model runner -> engine loop boundary.

The scheduler never imports torch; the runner consumes a `SchedulerOutput` and returns a
`RunnerOutput`. They are plain immutable records, so either side can be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagekeeper_engine.core.kv_copies import CopyFence
from pagekeeper_engine.core.sampling_params import SamplingParams


class ScheduledSeq(msgspec.Struct, frozen=True):
    """One sequence's share of a forward step.

    A frozen msgspec Struct rather than a frozen dataclass: the scheduler makes one for every
    scheduled sequence at every step, and a Struct is built in ~0.1 us where a frozen
    dataclass takes ~2 us (256 of them a step; docs/benchmarks-archive.md, "the host's
    loop")."""

    request_id: str
    token_ids: list[int]  # tokens computed this step: a prefill chunk, or the one decode token
    start_pos: int  # tokens of this sequence already in the KV cache before this step
    block_ids: list[int]  # the whole block table, covering start_pos + len(token_ids) tokens
    needs_sample: bool  # False for a prefill chunk that does not reach the prompt's end
    sampling: SamplingParams
    num_output_tokens: int  # tokens generated so far (seeds per-request generators)
    # The sequence's whole token list (shared, not copied: read at the step's launch only,
    # by the penalties) and how many of its tokens are the prompt's.
    all_token_ids: list[int] = []
    num_prompt_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """What to run in one step. Decodes come first, then prefill chunks."""

    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    # (src, dst) pairs: GPU block -> CPU block before the step, CPU block -> GPU block after
    # swap-in is decided; applied by the runner before the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # sequences whose blocks come back from the CPU in this step (their rows of blocks_to_swap_in)
    swapped_in_ids: list[str] = field(default_factory=list)
    # The host KV tier's copies (`core.kv_copies`), issued on side streams before the forward
    # pass: (host block, GPU block) loads, early and late, and (GPU block, host block) stores;
    # and how far the forward pass waits for them.
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_fence: CopyFence = CopyFence.NONE
    kv_late_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return (
            not self.seqs
            and not self.blocks_to_swap_out
            and not self.blocks_to_swap_in
            and not self.kv_loads
            and not self.kv_stores
            and not self.kv_late_loads
        )


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per `SchedulerOutput.seqs` entry, in order; None where nothing was sampled."""

    sampled_token_ids: list[int | None]
    logprobs: list[float | None]
    # per entry, the sampled token's top alternatives (token id, log-probability), likeliest
    # first, where its request asked for them; None when no request of the step did
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # entries whose reply was cut: the schema could not be continued in this vocabulary, so
    # the row was held to end-of-sequence (its reply ends as "length", not as a match)
    cut_seqs: list[int] = field(default_factory=list)
