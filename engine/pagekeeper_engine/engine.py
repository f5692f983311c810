"""The synchronous step loop: schedule, run the model, apply tokens, detokenize, stop.

Single-threaded by design (the model runner is not thread-safe); `AsyncLLMEngine` drives it
from one thread. Imports no torch: the runner and tokenizer come in through the protocols below.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus, check_token_stop
from pagekeeper_engine.core.stats import FINISH_REASONS, EngineStats

__all__ = [
    "LLMEngine",
    "ModelRunnerProtocol",
    "RequestOutput",
    "RequestRejectedError",
    "TokenizerProtocol",
]

logger = logging.getLogger(__name__)


class ModelRunnerProtocol(Protocol):
    """Runs one scheduled step on the device and samples; owns the KV-cache tensors.

    `execute` first applies `blocks_to_swap_out` (GPU -> CPU) and `blocks_to_swap_in`
    (CPU -> GPU) - a step never has both - then the forward pass. Block 0 of the GPU pool is
    never given to a sequence (free to use as padding).
    """

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


class TokenizerProtocol(Protocol):
    """Text <-> token ids. `decode` is what the client sees (special tokens skipped)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LLMEngine:
    """Continuous-batching generation over a paged KV cache, one `step()` at a time.

    `add_request` queues (or raises RequestRejectedError for a request that can never run),
    `step` runs one batch and returns what each touched request produced, `abort` ends a
    request and frees its blocks (its final output comes from the next `step`). A step whose
    runner raises is logged, and the requests in it fail with an `error` in their output.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunnerProtocol,
        tokenizer: TokenizerProtocol,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig.from_engine_config(config),
            runner.num_gpu_blocks,
            runner.num_cpu_blocks,
        )
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._pending: list[RequestOutput] = []
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_success = dict.fromkeys(FINISH_REASONS, 0)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejectedError for a request that can never run. Reads only settings,
        so other threads may call it."""
        if params.max_tokens < 1:
            raise RequestRejectedError(f"max_tokens must be at least 1, got {params.max_tokens}")
        self.scheduler.check_request(len(prompt_token_ids))

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.check_request(prompt_token_ids, params)
        self.scheduler.add_request(Sequence(request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> bool:
        """End a request and free its blocks; False when it is not in flight."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.append(_output(seq, [], "", []))
        return True

    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        if out.is_empty:
            return outputs
        try:
            runner_out = self.runner.execute(out)
        except Exception as exc:  # the runner's failure must not take the loop down
            return outputs + self._fail_step(out, exc)
        self.num_steps += 1
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total += out.num_batched_tokens
        for seq in self.scheduler.update(out, runner_out):
            outputs.append(self._process_token(seq))
        return outputs

    def stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv
        pool = kv.pool
        cpu_pool = sched.cpu_pool
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            kv_cache_usage=pool.num_used_blocks / pool.num_usable_blocks,
            num_gpu_blocks=pool.num_usable_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_cache_only_blocks=pool.num_evictable_blocks,
            kv_internal_fragmentation=kv.internal_fragmentation(sched.running),
            num_cpu_blocks=cpu_pool.num_usable_blocks if cpu_pool is not None else 0,
            num_swap_blocks_used=cpu_pool.num_used_blocks if cpu_pool is not None else 0,
            prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits,
            num_prefix_cache_evictions=pool.num_evictions,
            num_preemptions=sched.num_preemptions,
            num_swap_preemptions=sched.num_swap_preemptions,
            num_recompute_preemptions=sched.num_recompute_preemptions,
            num_steps=self.num_steps,
            num_failed_steps=self.num_failed_steps,
            num_batched_tokens_total=self.num_batched_tokens_total,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_requests_success=dict(self.num_requests_success),
        )

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        # swaps were booked but maybe not copied: every sequence whose blocks moved is suspect
        affected = [s.request_id for s in out.seqs] + out.preempted_ids + out.swapped_in_ids
        logger.exception("step failed; failing requests %s", sorted(set(affected)))
        self.num_failed_steps += 1
        self.num_consecutive_failed_steps += 1
        error = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        outputs = []
        for request_id in dict.fromkeys(affected):
            seq = self.scheduler.requests.get(request_id)
            if seq is not None:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                outputs.append(_output(seq, [], "", [], error=error))
        return outputs

    def _process_token(self, seq: Sequence) -> RequestOutput:
        params = seq.sampling
        self.num_generation_tokens += 1
        if seq.num_output_tokens == 1:
            self.num_prompt_tokens += seq.num_prompt_tokens
        status = check_token_stop(seq, self._eos_token_ids, self.scheduler.max_seq_len)
        # a stop token ends the text without showing up in it
        if status is not SequenceStatus.FINISHED_STOPPED:
            num_old_chars = len(seq.output_text)
            _detokenize_next(self.tokenizer, seq)
            if params.stop and seq.num_output_tokens >= params.min_tokens:
                cut = _find_stop_string(seq.output_text, params.stop, num_old_chars)
                if cut is not None:
                    seq.output_text = seq.output_text[:cut]
                    status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(seq, status)
            num_visible = len(seq.output_text)
        else:
            # text that may still become the start of a stop string stays back
            num_held = max((len(s) for s in params.stop), default=1) - 1
            num_visible = max(seq.num_text_emitted, len(seq.output_text) - num_held)
        new_text = seq.output_text[seq.num_text_emitted : num_visible]
        seq.num_text_emitted = num_visible
        logprobs = [seq.output_logprobs[-1]] if params.logprobs else []
        return _output(seq, [seq.token_ids[-1]], new_text, logprobs)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        reason = status.finish_reason
        assert reason is not None
        self.num_requests_success[reason] += 1


def _output(
    seq: Sequence,
    new_token_ids: list[int],
    new_text: str,
    logprobs: list[float | None],
    error: str | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        new_text=new_text,
        finished=seq.status.is_finished,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
        error=error,
    )


def _detokenize_next(tokenizer: TokenizerProtocol, seq: Sequence) -> None:
    """Append the newest token's text to `seq.output_text`.

    Decodes a short window (`prefix_offset:`) rather than the whole output, and the window
    without the new tokens (`prefix_offset:read_offset`), taking the difference: tokens merge
    across boundaries (leading spaces, multi-byte characters). A window ending in U+FFFD is an
    incomplete UTF-8 sequence: wait for the next token.
    """
    ids = seq.token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    full_text = tokenizer.decode(ids[seq.prefix_offset :])
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.output_text += full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def _find_stop_string(text: str, stops: tuple[str, ...], num_old_chars: int) -> int | None:
    """Where the earliest stop string that ends in the new text begins, or None."""
    cuts = []
    for stop in stops:
        if not stop:
            continue
        start = max(0, num_old_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            cuts.append(index)
    return min(cuts, default=None)
