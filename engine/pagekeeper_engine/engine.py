"""The synchronous step loop: schedule, run the model, apply tokens, detokenize, stop.

Single-threaded by design (the model runner is not thread-safe); `AsyncLLMEngine` drives it
from one thread. Imports no torch: the runner and tokenizer come in through the protocols below.

Out of device memory inside a step, the loop does not fail the step's requests: the runner has
freed what the step allocated and the scheduler's state is as before the step (no token was
computed), so it halves the step's token budget (`memory.step_budget`), preempts the running
sequences that the smaller budget cannot serve, newest first, and schedules again. Only after
`--max-consecutive-ooms` such errors with no clean step between them does it give up
(`EngineOutOfMemoryError`).

Asynchronous scheduling (`--async-scheduling`, on by default where the runner prefers it, i.e.
on CUDA): each `step()` schedules and launches step N+1 while the device still runs step N,
then reads step N's tokens back and applies them. The scheduler books one unknown token for
every sequence step N samples (a placeholder the runner fills on the device from step N's
sampled ids), so the host's scheduling, packing and bookkeeping hide behind the device's work.
A sequence that stops at step N has taken part in step N+1 for nothing: that token is dropped
and its computed count rolled back before its blocks are freed, so the KV accounting is what
the synchronous loop would hold. Errors first settle the step in flight, then are handled as
in the synchronous loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus, check_token_stop
from pagekeeper_engine.core.stats import FINISH_REASONS, EngineStats
from pagekeeper_engine.memory.allocator import AllocatorStats, PeriodicReader
from pagekeeper_engine.memory.oom import (
    OOM_EVENT_KINDS,
    DeviceOutOfMemoryError,
    EngineOutOfMemoryError,
)
from pagekeeper_engine.memory.step_budget import StepTokenBudget

__all__ = [
    "AllocatorMonitorProtocol",
    "DefragmentResult",
    "LLMEngine",
    "LoopStats",
    "ModelRunnerProtocol",
    "RequestOutput",
    "RequestRejectedError",
    "TokenizerProtocol",
]

logger = logging.getLogger(__name__)

ALLOCATOR_READ_INTERVAL_S = 1.0  # allocator statistics are read at most this often


class AllocatorMonitorProtocol(Protocol):
    """The device's caching allocator (`memory.cuda.CudaAllocatorMonitor`); absent on the CPU."""

    def read(self) -> AllocatorStats: ...

    def release_cached(self) -> int: ...


@dataclass(frozen=True)
class LoopStats(EngineStats):
    """`EngineStats` plus what the step loop knows of memory: out-of-memory events by kind,
    the live step token budget, and the newest allocator reading (None on the CPU)."""

    num_oom_events: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(OOM_EVENT_KINDS, 0))
    )
    step_token_budget: int = 0
    max_step_token_budget: int = 0
    allocator: AllocatorStats | None = None


@dataclass(frozen=True)
class DefragmentResult:
    """What `/admin/defragment` reports. `is_done` False: too busy (nothing was released)."""

    is_done: bool
    num_running: int
    bytes_freed: int = 0
    before: AllocatorStats | None = None
    after: AllocatorStats | None = None
    seconds: float = 0.0


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

    @property
    def num_swap_ooms(self) -> int:
        """Swaps that found no device memory and fell back to an allocation-free copy."""
        ...

    @property
    def allocator_monitor(self) -> AllocatorMonitorProtocol | None: ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Raises DeviceOutOfMemoryError, having freed the step's memory, when the device
        runs out; the KV cache holds what it held before the step."""
        ...


class PendingStepProtocol(Protocol):
    """A launched step whose sampled tokens are still on their way to the host."""

    def result(self) -> RunnerOutput:
        """Wait for the tokens (the same object `execute` would have returned)."""
        ...


class AsyncModelRunnerProtocol(ModelRunnerProtocol, Protocol):
    """A runner that can launch a step without waiting for it.

    `launch` enqueues the step and returns at once; a row whose input token is
    `PLACEHOLDER_TOKEN_ID` takes the token the previous launched step sampled for the same
    request. `result()` of a step must be called before the step after next is launched.
    """

    @property
    def prefers_async_scheduling(self) -> bool:
        """Whether overlapping pays (a device that runs beside the host)."""
        ...

    def launch(self, out: SchedulerOutput) -> PendingStepProtocol: ...


@dataclass
class _InFlight:
    """A launched step: what was scheduled, the sequences it booked, its pending tokens."""

    out: SchedulerOutput
    seqs: list[Sequence]
    pending: PendingStepProtocol


class TokenizerProtocol(Protocol):
    """Text <-> token ids. `decode` is what the client sees (special tokens skipped).

    A tokenizer that also has `decode_batch(list[list[int]]) -> list[str]` (the same as
    `decode` on each) lets the loop detokenize a whole step in one call.
    """

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LLMEngine:
    """Continuous-batching generation over a paged KV cache, one `step()` at a time.

    `add_request` queues (or raises RequestRejectedError for a request that can never run),
    `step` runs one batch and returns what each touched request produced, `abort` ends a
    request and frees its blocks (its final output comes from the next `step`). A step whose
    runner raises is logged, and the requests in it fail with an `error` in their output; a
    step that runs out of device memory is retried smaller (see the module docstring).
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
        self.step_budget = StepTokenBudget(self.scheduler.max_num_batched_tokens)
        self.max_consecutive_ooms = config.max_consecutive_ooms
        self.num_oom_events = dict.fromkeys(OOM_EVENT_KINDS, 0)
        self._num_swap_ooms_seen = 0
        # The scheduler reads its step budget in check_request too (without chunked prefill a
        # prompt must fit one step): other threads check requests under this lock, and the step
        # loop shrinks the budget only while it holds it.
        self._budget_lock = threading.Lock()
        monitor = runner.allocator_monitor
        self._allocator = (
            PeriodicReader(monitor.read, ALLOCATOR_READ_INTERVAL_S) if monitor is not None else None
        )
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._decode_batch: Callable[[list[list[int]]], list[str]] = getattr(
            tokenizer, "decode_batch", None
        ) or (lambda windows: [tokenizer.decode(w) for w in windows])
        self._launch = _resolve_launch(config, runner)
        self._in_flight: _InFlight | None = None
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
        with self._budget_lock:
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

    @property
    def is_async(self) -> bool:
        """Whether steps overlap (see the module docstring)."""
        return self._launch is not None

    def has_work(self) -> bool:
        return bool(self._pending) or self._in_flight is not None or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One batch. Raises EngineOutOfMemoryError when out-of-memory errors repeat past
        `max_consecutive_ooms`: the engine cannot serve at any step size and must restart."""
        if self._launch is not None:
            return self._step_async(self._launch)
        out = self._schedule()
        outputs, self._pending = self._pending, []
        if out.is_empty:
            if self.step_budget.is_reduced and self.scheduler.has_work():
                # nothing fits the reduced budget (a prompt without chunked prefill, say)
                self.step_budget.restore()
            return outputs
        try:
            runner_out = self.runner.execute(out)
        except DeviceOutOfMemoryError as exc:
            self._count_swap_ooms()
            self._recover_from_oom(out, exc)
            return outputs
        except Exception as exc:  # the runner's failure must not take the loop down
            self._count_swap_ooms()
            return outputs + self._fail_step(out, exc)
        self._count_swap_ooms()
        self.step_budget.on_clean_step()
        self.num_steps += 1
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total += out.num_batched_tokens
        outputs += self._process_tokens(self.scheduler.update(out, runner_out))
        if self._allocator is not None:
            self._allocator.maybe_read()
        return outputs

    def _step_async(
        self, launch: Callable[[SchedulerOutput], PendingStepProtocol]
    ) -> list[RequestOutput]:
        """Launch the next step, then settle the one in flight (its tokens were sampled while
        this one was being scheduled)."""
        out = self._schedule()
        outputs, self._pending = self._pending, []
        if out.is_empty:
            if self._in_flight is not None:
                return outputs + self._settle()
            if self.step_budget.is_reduced and self.scheduler.has_work():
                self.step_budget.restore()
            return outputs
        try:
            pending = launch(out)
        except DeviceOutOfMemoryError as exc:
            self._count_swap_ooms()
            outputs += self._settle()  # recovery preempts with every token known
            self._recover_from_oom(out, exc)
            return outputs
        except Exception as exc:  # the runner's failure must not take the loop down
            self._count_swap_ooms()
            outputs += self._settle()
            return outputs + self._fail_step(out, exc)
        self._count_swap_ooms()
        previous, self._in_flight = (
            self._in_flight,
            _InFlight(out, self.scheduler.advance(out), pending),
        )
        self.step_budget.on_clean_step()
        self.num_steps += 1
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total += out.num_batched_tokens
        if previous is not None:
            outputs += self._settle(previous)
        if self._allocator is not None:
            self._allocator.maybe_read()
        return outputs

    def _settle(self, step: _InFlight | None = None) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them (default: the step in flight).

        A step that fails here fails its requests, and the one launched after it too (its
        inputs came from the failed one)."""
        if step is None:
            step, self._in_flight = self._in_flight, None
            if step is None:
                return []
        try:
            runner_out = step.pending.result()
        except Exception as exc:
            outputs = self._fail_step(step.out, exc)
            later, self._in_flight = self._in_flight, None
            if later is not None:
                outputs += self._fail_step(later.out, exc)
            return outputs
        return self._process_tokens(self.scheduler.fill(step.out, step.seqs, runner_out))

    def drain(self) -> None:
        """Settle the step in flight now; its outputs come with the next `step()`."""
        self._pending += self._settle()

    def _schedule(self) -> SchedulerOutput:
        budget = self.step_budget
        if not budget.is_reduced:
            return self.scheduler.schedule()
        with self._budget_lock:
            self.scheduler.max_num_batched_tokens = budget.current
            try:
                return self.scheduler.schedule()
            finally:
                self.scheduler.max_num_batched_tokens = budget.ceiling

    def _count_swap_ooms(self) -> None:
        num_new = self.runner.num_swap_ooms - self._num_swap_ooms_seen
        if num_new:
            self._num_swap_ooms_seen += num_new
            self.num_oom_events["swap"] += num_new

    def _recover_from_oom(self, out: SchedulerOutput, exc: DeviceOutOfMemoryError) -> None:
        """Shrink the step, preempt what the smaller step cannot serve, retry next step."""
        self.num_oom_events[exc.kind] += 1
        failed_budget = self.step_budget.current
        new_budget = self.step_budget.on_oom()
        num_in_a_row = self.step_budget.num_consecutive_ooms
        if num_in_a_row > self.max_consecutive_ooms:
            raise EngineOutOfMemoryError(
                f"{num_in_a_row} out-of-memory errors in a row, the last at a step of "
                f"{out.num_batched_tokens} tokens ({len(out.seqs)} sequences) within a step "
                f"budget of {failed_budget} of {self.step_budget.ceiling} tokens: {exc}"
            )
        step_ids = {s.request_id for s in out.seqs}
        sched = self.scheduler
        num_preempted = 0
        # every running sequence needs at least one token of a step; the newest beyond the
        # budget would only wait, holding blocks, so they go back to the queue
        for seq in reversed(list(sched.running)):
            if len(sched.running) <= new_budget:
                break
            if seq.request_id in step_ids:
                _preempt_for_recompute(sched, seq)
                num_preempted += 1
        logger.warning(
            "out of device memory in a step of %d tokens (%d sequences): step budget now %d, "
            "%d sequences preempted, %d errors in a row; retrying: %s",
            out.num_batched_tokens,
            len(out.seqs),
            new_budget,
            num_preempted,
            num_in_a_row,
            exc,
        )

    def sample_memory(self) -> None:
        """Refresh the allocator reading if one is due (the idle loop calls this)."""
        if self._allocator is not None:
            self._allocator.maybe_read()

    def defragment(self, max_running: int) -> DefragmentResult:
        """Release the allocator's cached segments if at most `max_running` sequences run.

        Call on the thread that steps: no step is in flight while the cache is emptied.
        """
        assert self._allocator is not None and self.runner.allocator_monitor is not None
        self.drain()
        num_running = len(self.scheduler.running)
        if num_running > max_running:
            return DefragmentResult(is_done=False, num_running=num_running)
        started = time.monotonic()
        before = self._allocator.read_now()
        bytes_freed = self.runner.allocator_monitor.release_cached()
        after = self._allocator.read_now()
        return DefragmentResult(
            is_done=True,
            num_running=num_running,
            bytes_freed=bytes_freed,
            before=before,
            after=after,
            seconds=time.monotonic() - started,
        )

    @property
    def has_allocator(self) -> bool:
        return self._allocator is not None

    def stats(self) -> LoopStats:
        sched = self.scheduler
        kv = sched.kv
        pool = kv.pool
        cpu_pool = sched.cpu_pool
        return LoopStats(
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
            num_oom_events=dict(self.num_oom_events),
            step_token_budget=self.step_budget.current,
            max_step_token_budget=self.step_budget.ceiling,
            allocator=self._allocator.latest if self._allocator is not None else None,
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

    def _process_tokens(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Stop checks, detokenization (one batch for the step) and outputs, in batch order."""
        self.num_generation_tokens += len(seqs)
        statuses = []
        for seq in seqs:
            if seq.num_known_output_tokens == 1:
                self.num_prompt_tokens += seq.num_prompt_tokens
            statuses.append(check_token_stop(seq, self._eos_token_ids, self.scheduler.max_seq_len))
        # a stop token ends the text without showing up in it
        shown = [
            s
            for s, status in zip(seqs, statuses, strict=True)
            if status is not SequenceStatus.FINISHED_STOPPED
        ]
        old_lengths = dict(
            zip(map(id, shown), _detokenize_next(self._decode_batch, shown), strict=True)
        )
        return [
            self._emit(seq, status, old_lengths.get(id(seq)))
            for seq, status in zip(seqs, statuses, strict=True)
        ]

    def _emit(
        self, seq: Sequence, status: SequenceStatus | None, num_old_chars: int | None
    ) -> RequestOutput:
        """Apply stop strings to the newly decoded text (`num_old_chars` None: not decoded),
        finish or keep the sequence, and build its output."""
        params = seq.sampling
        if (
            num_old_chars is not None
            and params.stop
            and seq.num_known_output_tokens >= params.min_tokens
        ):
            cut = _find_stop_string(seq.output_text, params.stop, num_old_chars)
            if cut is not None:
                seq.output_text = seq.output_text[:cut]
                status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(seq, status)
            num_visible = len(seq.output_text)
        else:
            self.scheduler.cache_known_blocks(seq)
            # text that may still become the start of a stop string stays back
            num_held = max((len(s) for s in params.stop), default=1) - 1
            num_visible = max(seq.num_text_emitted, len(seq.output_text) - num_held)
        new_text = seq.output_text[seq.num_text_emitted : num_visible]
        seq.num_text_emitted = num_visible
        num_known_outputs = seq.num_known_output_tokens
        logprobs = [seq.output_logprobs[num_known_outputs - 1]] if params.logprobs else []
        return _output(seq, [seq.last_known_token_id], new_text, logprobs)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.discard_pending(seq)
        self.scheduler.finish(seq, status)
        reason = status.finish_reason
        assert reason is not None
        self.num_requests_success[reason] += 1


def _preempt_for_recompute(sched: Scheduler, seq: Sequence) -> None:
    """Back to the head of the queue with no blocks; it recomputes (mostly prefix-cache hits:
    its full blocks stay cached) when it is admitted again."""
    sched.running.remove(seq)
    sched.kv.free(seq)
    seq.num_computed_tokens = 0
    seq.num_preemptions += 1
    seq.status = SequenceStatus.WAITING
    sched.waiting.appendleft(seq)
    sched.num_recompute_preemptions += 1


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
        num_output_tokens=seq.num_known_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
        error=error,
    )


def _detokenize_next(
    decode_batch: Callable[[list[list[int]]], list[str]], seqs: list[Sequence]
) -> list[int]:
    """Append each sequence's newest known token's text to its `output_text`; returns the
    lengths of the texts before.

    Decodes a short window (`prefix_offset:`) rather than the whole output, and the window
    without the new tokens (`prefix_offset:read_offset`), taking the difference: tokens merge
    across boundaries (leading spaces, multi-byte characters). A window ending in U+FFFD is an
    incomplete UTF-8 sequence: wait for the next token. Both windows of every sequence go to
    the tokenizer in one call.
    """
    if not seqs:
        return []
    windows = []
    for seq in seqs:
        ids = seq.token_ids
        windows.append(ids[seq.prefix_offset : seq.read_offset])
        windows.append(ids[seq.prefix_offset : seq.num_known_tokens])
    texts = decode_batch(windows)
    old_lengths = []
    for index, seq in enumerate(seqs):
        prefix_text, full_text = texts[2 * index], texts[2 * index + 1]
        old_lengths.append(len(seq.output_text))
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            seq.output_text += full_text[len(prefix_text) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = seq.num_known_tokens
    return old_lengths


def _resolve_launch(
    config: EngineConfig, runner: ModelRunnerProtocol
) -> Callable[[SchedulerOutput], PendingStepProtocol] | None:
    """The runner's `launch` when steps are to overlap: `config.async_scheduling`, or where
    it is unset, the runner's preference."""
    launch = getattr(runner, "launch", None)
    wanted = config.async_scheduling
    if wanted is None:
        wanted = bool(getattr(runner, "prefers_async_scheduling", False))
    if not wanted:
        return None
    if launch is None:
        raise ValueError("asynchronous scheduling needs a runner that can launch steps")
    return launch  # type: ignore[no-any-return]


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
