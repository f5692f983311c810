"""The step loop: schedule, run the model, apply tokens, stop on stop tokens and lengths.

Single-threaded by design (the model runner is not thread-safe); the engine core's process
(`loop.engine_core`) drives it, and benchmarks drive it in-process. Imports no torch: the
runner comes in through the structural protocols of `core.protocols`. Outputs are token ids
(`messages.EngineOutput`, built with the stop checks by `request_outputs`); text, stop strings
and their hold-back belong to the front end, which ends a request whose stop string matched
with `abort(request_id, "stop")`.

Out of device memory inside a step, the loop does not fail the step's requests: it shrinks the
step and retries (`oom_recovery`). What `stats()` and `defragment()` report is
`loop_stats`.

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
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.kv_events import KVEventLog
from pagekeeper_engine.core.limits import RequestRejectedError, SchedulerConfig
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.protocols import (
    ModelRunnerProtocol,
    PendingStepProtocol,
    resolve_launch,
)
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.core.sequence import Sequence
from pagekeeper_engine.faults import FatalEngineError
from pagekeeper_engine.loop.loop_stats import release_cached, snapshot
from pagekeeper_engine.loop.oom_recovery import OomRecovery
from pagekeeper_engine.loop.request_outputs import RequestOutputs, cut_request_ids
from pagekeeper_engine.loop.step_time import StepHostSeconds
from pagekeeper_engine.memory.allocator import PeriodicReader
from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError
from pagekeeper_engine.memory.step_budget import StepTokenBudget
from pagekeeper_engine.messages import DefragmentResult, EngineOutput, LoopStats

logger = logging.getLogger(__name__)

ALLOCATOR_READ_INTERVAL_S = 1.0  # allocator statistics are read at most this often


@dataclass
class _InFlight:
    """A launched step: what was scheduled, the sequences it booked, its pending tokens."""

    out: SchedulerOutput
    seqs: list[Sequence]
    pending: PendingStepProtocol


class LLMEngine:
    """Continuous-batching generation over a paged KV cache, one `step()` at a time.

    `add_request` queues (or raises RequestRejectedError for a request that can never run),
    `step` runs one batch and returns what each touched request produced, `abort` ends a
    request and frees its blocks (its final output comes from the next `step`). `eos_token_ids`
    end a request unless it ignores EOS. A step whose
    runner raises is logged, and the requests in it fail with an `error` in their output; a
    step that runs out of device memory is retried smaller (see the module docstring).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunnerProtocol,
        eos_token_ids: frozenset[int],
        scheduler_config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,  # times the parts of each step
        check_sampling: Callable[[SamplingParams], None] | None = None,  # the runner's check
    ) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig.from_engine_config(config, runner.limits),
            runner.num_gpu_blocks,
            runner.num_cpu_blocks,
            runner.num_host_blocks,
        )
        self._oom = OomRecovery(self.scheduler, config.max_consecutive_ooms)
        # what the prefix cache's tiers gained and lost (`core.kv_events`), when asked for
        events = config.kv_events_config
        self.kv_events: KVEventLog | None = None
        if events is not None and events.enable_kv_cache_events:
            self.kv_events = KVEventLog(self.scheduler.kv.block_size)
            self.scheduler.kv.events = self.kv_events
        monitor = runner.allocator_monitor
        self._allocator = (
            PeriodicReader(monitor.read, ALLOCATOR_READ_INTERVAL_S) if monitor is not None else None
        )
        # stop checks, finished requests and their outputs; token and finish counts
        self.request_outputs = RequestOutputs(self.scheduler, eos_token_ids)
        self._check_sampling = check_sampling
        self._launch = resolve_launch(config, runner)
        self._in_flight: _InFlight | None = None
        self._pending: list[EngineOutput] = []
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total = 0
        self._clock = clock
        self.host_seconds = StepHostSeconds()  # where this thread spent its steps

    @property
    def device_wait_seconds(self) -> float:
        """Seconds spent collecting launched steps' tokens (`LoopStats`)."""
        return self.host_seconds.wait

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejectedError for a request that can never run."""
        if params.max_tokens < 1:
            raise RequestRejectedError(f"max_tokens must be at least 1, got {params.max_tokens}")
        self._oom.check_request(len(prompt_token_ids))
        if self._check_sampling is not None:
            self._check_sampling(params)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.check_request(prompt_token_ids, params)
        self.scheduler.add_request(Sequence(request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request and free its blocks; False when it is not in flight. `reason` "stop":
        the front end found a stop string (the request counts as stopped, not aborted)."""
        output = self.request_outputs.abort(request_id, reason)
        if output is None:
            return False
        self._pending.append(output)
        return True

    @property
    def step_budget(self) -> StepTokenBudget:
        """The live step token budget (smaller than configured after out-of-memory errors)."""
        return self._oom.budget

    @step_budget.setter
    def step_budget(self, budget: StepTokenBudget) -> None:
        self._oom.budget = budget

    @property
    def is_async(self) -> bool:
        """Whether steps overlap (see the module docstring)."""
        return self._launch is not None

    def has_work(self) -> bool:
        return bool(self._pending) or self._in_flight is not None or self.scheduler.has_work()

    def step(self) -> list[EngineOutput]:
        """One batch. Raises EngineOutOfMemoryError when out-of-memory errors repeat past
        `max_consecutive_ooms`: the engine cannot serve at any step size and must restart."""
        if self._launch is not None:
            return self._step_async(self._launch)
        clock, spent = self._clock, self.host_seconds
        started = clock()
        out = self._oom.schedule()
        scheduled = clock()
        spent.schedule += scheduled - started
        outputs, self._pending = self._pending, []
        if out.is_empty:
            self._oom.on_empty_step()
            return outputs
        try:
            runner_out = self.runner.execute(out)
            executed = clock()
            spent.launch += executed - scheduled
        except DeviceOutOfMemoryError as exc:
            self._count_swap_ooms()
            self._oom.on_oom(out, exc)
            return outputs
        except FatalEngineError:
            raise
        except Exception as exc:  # the runner's failure must not take the loop down
            self._count_swap_ooms()
            return outputs + self._fail_step(out, exc)
        self._count_swap_ooms()
        self._oom.on_clean_step()
        self.num_steps += 1
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total += out.num_batched_tokens
        outputs += self.request_outputs.apply(
            self.scheduler.update(out, runner_out), cut_request_ids(out, runner_out)
        )
        spent.apply += clock() - executed
        if self._allocator is not None:
            self._allocator.maybe_read()
        return outputs

    def _step_async(
        self, launch: Callable[[SchedulerOutput], PendingStepProtocol]
    ) -> list[EngineOutput]:
        """Launch the next step, then settle the one in flight (its tokens were sampled while
        this one was being scheduled)."""
        clock, spent = self._clock, self.host_seconds
        started = clock()
        out = self._oom.schedule()
        scheduled = clock()
        spent.schedule += scheduled - started
        outputs, self._pending = self._pending, []
        if out.is_empty:
            if self._in_flight is not None:
                return outputs + self._settle()
            self._oom.on_empty_step()
            return outputs
        try:
            pending = launch(out)
        except DeviceOutOfMemoryError as exc:
            self._count_swap_ooms()
            outputs += self._settle()  # recovery preempts with every token known
            self._oom.on_oom(out, exc)
            return outputs
        except FatalEngineError:
            raise
        except Exception as exc:  # the runner's failure must not take the loop down
            self._count_swap_ooms()
            outputs += self._settle()
            return outputs + self._fail_step(out, exc)
        self._count_swap_ooms()
        launched = clock()
        spent.launch += launched - scheduled
        previous, self._in_flight = (
            self._in_flight,
            _InFlight(out, self.scheduler.advance(out), pending),
        )
        spent.book += clock() - launched
        self._oom.on_clean_step()
        self.num_steps += 1
        self.num_consecutive_failed_steps = 0
        self.num_batched_tokens_total += out.num_batched_tokens
        if previous is not None:
            outputs += self._settle(previous)
        if self._allocator is not None:
            self._allocator.maybe_read()
        return outputs

    def _settle(self, step: _InFlight | None = None) -> list[EngineOutput]:
        """Read a launched step's tokens back and apply them (default: the step in flight).

        A step that fails here fails its requests, and the one launched after it too (its
        inputs came from the failed one)."""
        if step is None:
            step, self._in_flight = self._in_flight, None
            if step is None:
                return []
        clock, spent = self._clock, self.host_seconds
        try:
            started = clock()
            runner_out = step.pending.result()
            waited = clock()
            spent.wait += waited - started
        except FatalEngineError:
            raise
        except Exception as exc:
            outputs = self._fail_step(step.out, exc)
            later, self._in_flight = self._in_flight, None
            if later is not None:
                outputs += self._fail_step(later.out, exc)
            return outputs
        outputs = self.request_outputs.apply(
            self.scheduler.fill(step.out, step.seqs, runner_out),
            cut_request_ids(step.out, runner_out),
        )
        spent.apply += clock() - waited
        return outputs

    def drain(self) -> None:
        """Settle the step in flight now; its outputs come with the next `step()`."""
        self._pending += self._settle()

    def begin_shutdown(self) -> None:
        """The engine is draining or stopping: report every cached block gone (a KV-aware
        router must stop sending prefixes here) and report no new ones."""
        if self.kv_events is not None:
            self.kv_events.close()

    def _count_swap_ooms(self) -> None:
        self._oom.count_swap_ooms(self.runner.num_swap_ooms)

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
        return release_cached(self.runner.allocator_monitor, self._allocator, num_running)

    @property
    def has_allocator(self) -> bool:
        return self._allocator is not None

    def stats(self) -> LoopStats:
        requests = self.request_outputs
        return snapshot(
            self.scheduler,
            self._oom,
            self._allocator.latest if self._allocator is not None else None,
            num_steps=self.num_steps,
            num_failed_steps=self.num_failed_steps,
            num_batched_tokens_total=self.num_batched_tokens_total,
            num_prompt_tokens=requests.num_prompt_tokens,
            num_generation_tokens=requests.num_generation_tokens,
            num_requests_success=requests.num_requests_success,
            num_consecutive_failed_steps=self.num_consecutive_failed_steps,
            device_wait_seconds=self.device_wait_seconds,
            host_block_bytes=self.runner.host_block_bytes,
            kv_load_seconds=self.runner.kv_load_seconds,
            grammar=self.runner.grammar_timings,
        )

    def count_failed_step(self) -> None:
        """Count a step that failed, wherever it failed: the front ends' health check reads the
        consecutive count, so a loop that fails every step stops looking alive."""
        self.num_failed_steps += 1
        self.num_consecutive_failed_steps += 1

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[EngineOutput]:
        # swaps were booked but maybe not copied: every sequence whose blocks moved is suspect
        affected = [s.request_id for s in out.seqs] + out.preempted_ids + out.swapped_in_ids
        logger.exception("step failed; failing requests %s", sorted(set(affected)))
        self.count_failed_step()
        error = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        return self.request_outputs.fail(affected, error)
