"""One request's tokens, KV blocks and lifecycle, as the scheduler and the engine loop see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagekeeper_engine.core.sampling_params import SamplingParams

# Stands for a token the device has sampled but the host has not read back yet (asynchronous
# scheduling): the runner fills the row from the previous step's sampled ids on the device.
PLACEHOLDER_TOKEN_ID = -1


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued, in the running batch, swapped to CPU, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` ("stop", "length", "abort"), None while unfinished."""
        return _FINISH_REASONS.get(self._value_)


# Keyed by the statuses' values: a str hashes in C, an Enum member through Python (the engine
# loop asks these of every sequence at every step).
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED.value: "stop",
    SequenceStatus.FINISHED_LENGTH.value: "length",
    SequenceStatus.FINISHED_ABORTED.value: "abort",
}


@dataclass(eq=False)
class Sequence:
    """A request in flight.

    `token_ids` is the prompt followed by every generated token. `num_computed_tokens` counts the
    leading tokens whose keys and values are in the KV cache; while decoding it is
    `num_tokens - 1` (the newest sampled token is the next step's input). `block_ids` is the
    block table: GPU block ids while WAITING/RUNNING, CPU block ids while SWAPPED.

    With asynchronous scheduling a step is booked before the previous one's tokens are known:
    `token_ids` then ends in `num_pending_tokens` placeholders (at most two: the step in flight
    and the one just launched), which `fill_placeholder` replaces oldest first. The `*known*`
    properties are the synchronous loop's view (equal to the plain ones when nothing is
    pending).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(init=False)
    output_logprobs: list[float | None] = field(default_factory=list)
    # output index -> that token's top alternatives, until the step loop hands them out
    top_logprobs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # prompt tokens served from the prefix cache at the first admission (usage reporting)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    # placeholders at the end of token_ids (asynchronous scheduling)
    num_pending_tokens: int = 0
    # chained hashes of the full blocks of token_ids, computed lazily (they never change:
    # tokens are only appended) and kept across preemption so a resumed sequence finds its
    # own blocks in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)
    # leading blocks of block_ids already registered in the prefix cache
    num_registered_blocks: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_known_tokens - len(self.prompt_token_ids)

    @property
    def last_known_token_id(self) -> int:
        return self.token_ids[self.num_known_tokens - 1]

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def append_placeholder(self) -> None:
        """Book a token the device is about to sample."""
        self.append_token(PLACEHOLDER_TOKEN_ID, None)
        self.num_pending_tokens += 1

    def fill_placeholder(self, token_id: int, logprob: float | None) -> None:
        """The oldest placeholder's value has arrived."""
        assert self.num_pending_tokens > 0, f"{self.request_id}: no token is pending"
        index = self.num_known_tokens
        self.token_ids[index] = token_id
        self.output_logprobs[index - len(self.prompt_token_ids)] = logprob
        self.num_pending_tokens -= 1

    def drop_placeholders(self) -> int:
        """Forget the pending tokens (a finished sequence's speculative step); how many."""
        num = self.num_pending_tokens
        if num:
            del self.token_ids[-num:]
            del self.output_logprobs[-num:]
            self.num_pending_tokens = 0
        return num


def check_token_stop(
    seq: Sequence, eos_token_ids: frozenset[int], max_seq_len: int
) -> SequenceStatus | None:
    """The finished status the newest known token puts `seq` in, or None to keep generating.

    Stop tokens (EOS unless ignore_eos, and stop_token_ids) count only once `min_tokens` tokens
    exist; they win over the length limit when both hold for the same token. Stop strings need
    the detokenized text and are checked by the front end.
    """
    params = seq.sampling
    num_output = seq.num_known_output_tokens
    if num_output == 0:
        return None
    last = seq.last_known_token_id
    if num_output >= params.min_tokens and (
        (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids
    ):
        return SequenceStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or seq.num_known_tokens >= max_seq_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
