"""What a step's tokens do to its requests: the stop checks, finishing a request (its blocks
freed, its finish reason counted) and the `EngineOutput` each request gets.

Imports no torch. The step loop (`loop.engine`) owns one `RequestOutputs` beside its scheduler
and hands it each step's sequences once their tokens are known.
"""

from __future__ import annotations

from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus, check_token_stop
from pagekeeper_engine.core.stats import FINISH_REASONS
from pagekeeper_engine.messages import EngineOutput


class RequestOutputs:
    """Stop checks and outputs over `scheduler`'s requests, and the counts `/metrics` reports:
    prompt and generated tokens, and finished requests by finish reason."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int]) -> None:
        self.scheduler = scheduler
        self._eos_token_ids = frozenset(eos_token_ids)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_success = dict.fromkeys(FINISH_REASONS, 0)

    def apply(
        self, seqs: list[Sequence], cut_ids: frozenset[str] = frozenset()
    ) -> list[EngineOutput]:
        """Stop checks, finishing or keeping each sequence, and outputs, in batch order. A
        sequence in `cut_ids` that stops was held to end-of-sequence by its schema, which this
        vocabulary could not continue: it ends as cut ("length"), not as a complete reply."""
        self.num_generation_tokens += len(seqs)
        max_seq_len = self.scheduler.max_seq_len
        outputs = []
        for seq in seqs:
            num_known_outputs = seq.num_known_output_tokens
            if num_known_outputs == 1:
                self.num_prompt_tokens += seq.num_prompt_tokens
            status = check_token_stop(seq, self._eos_token_ids, max_seq_len)
            if status is SequenceStatus.FINISHED_STOPPED and seq.request_id in cut_ids:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None:
                self.finish(seq, status)
            else:
                self.scheduler.cache_known_blocks(seq)
            logprobs = [seq.output_logprobs[num_known_outputs - 1]] if seq.sampling.logprobs else []
            top = None
            if seq.sampling.top_logprobs:  # a plain request's step does no dict work here
                top = seq.top_logprobs.pop(num_known_outputs - 1, None)
            outputs.append(
                engine_output(
                    seq,
                    [seq.last_known_token_id],
                    logprobs,
                    top_logprobs=[top] if top is not None else None,
                )
            )
        return outputs

    def abort(self, request_id: str, reason: str) -> EngineOutput | None:
        """End a request (`reason` "stop": as stopped, else as aborted) and its final output;
        None when it is not in flight."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return None
        status = (
            SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_ABORTED
        )
        self.finish(seq, status)
        return engine_output(seq, [], [])

    def fail(self, request_ids: list[str], error: str) -> list[EngineOutput]:
        """Abort each request still in flight, once, with `error` in its output."""
        outputs = []
        for request_id in dict.fromkeys(request_ids):
            seq = self.scheduler.requests.get(request_id)
            if seq is not None:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
                outputs.append(engine_output(seq, [], [], error=error))
        return outputs

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.discard_pending(seq)
        self.scheduler.finish(seq, status)
        reason = status.finish_reason
        assert reason is not None, f"{status} is not a finished status"
        self.num_requests_success[reason] += 1


def cut_request_ids(out: SchedulerOutput, runner_out: RunnerOutput) -> frozenset[str]:
    """The requests of a step whose replies the runner cut (`RunnerOutput.cut_seqs`)."""
    if not runner_out.cut_seqs:
        return frozenset()
    return frozenset(out.seqs[i].request_id for i in runner_out.cut_seqs)


def engine_output(
    seq: Sequence,
    new_token_ids: list[int],
    logprobs: list[float | None],
    error: str | None = None,
    top_logprobs: list[list[tuple[int, float]]] | None = None,
) -> EngineOutput:
    """`seq`'s output for one step: what it gained (`new_*`) and where it stands now."""
    finish_reason = seq.finish_reason
    return EngineOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_known_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs or [],
        error=error,
    )
