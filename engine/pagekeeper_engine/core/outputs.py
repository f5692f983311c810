"""Data objects that cross the scheduler -> model runner -> engine loop boundary.

The scheduler never imports torch; the runner consumes a `SchedulerOutput` and returns a
`RunnerOutput`. Both are plain dataclasses so either side can be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a forward step."""

    request_id: str
    token_ids: list[int]  # tokens computed this step: a prefill chunk, or the one decode token
    start_pos: int  # tokens of this sequence already in the KV cache before this step
    block_ids: list[int]  # the whole block table, covering start_pos + len(token_ids) tokens
    needs_sample: bool  # False for a prefill chunk that does not reach the prompt's end
    sampling: SamplingParams
    num_output_tokens: int  # tokens generated so far (seeds per-request generators)

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

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per `SchedulerOutput.seqs` entry, in order; None where nothing was sampled."""

    sampled_token_ids: list[int | None]
    logprobs: list[float | None]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: its new tokens and text, and whether it ended.

    `new_text` never contains a stop string, nor text that could still turn out to begin one
    (held back until it cannot). `logprobs` has one entry per new token when the request asked
    for logprobs, else it is empty. `error` is set when the request failed inside the engine
    (finish_reason is then "abort").
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[float | None] = field(default_factory=list)
    error: str | None = None


def request_output(
    seq: Sequence,
    new_token_ids: list[int],
    new_text: str,
    logprobs: list[float | None],
    error: str | None = None,
) -> RequestOutput:
    """`seq`'s output for one step: what it gained (`new_*`) and where it stands now."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        new_text=new_text,
        finished=seq.status.is_finished,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_known_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
        error=error,
    )
