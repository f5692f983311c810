"""The model runner: owns the model, the KV cache pool, the swap pool and the sampler, which
its start-up stages (`setup.py`) leave; this module is its step path.

It consumes the scheduler's plain `SchedulerOutput`, turns it into packed tensors and
`AttentionMetadata`, runs the forward pass, computes logits only for the rows that are sampled,
and returns plain token ids. It makes no scheduling decision of its own.

`launch` enqueues a step (`step_launch.py`) and returns before the device has run it: the
sampled ids stay on the device (the next step's placeholder inputs gather from them there) and
travel to the host as `step_results.py` describes. `execute` is `launch(...).result()`.

Under tensor parallelism there is one runner per rank, each over its shard of the model and of
every KV block (`model/shard.py`). Rank 0's runner, in the engine core, hands each step to
`followers` (the other ranks, `executor/workers.py`) before it runs it; every rank then runs the
same forward in lockstep. The ranks pick the common batches across their vocabulary shards
(`shard_pick.py`); rank 0 samples the others and broadcasts the ids, so every rank's next step
reads the same placeholders.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekeeper_engine.core.kv_copies import StepCopies
from pagekeeper_engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.faults import FatalEngineError
from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError
from pagekeeper_engine.runner.follower_step import FollowerStep, follower_step
from pagekeeper_engine.runner.setup import RunnerSetup
from pagekeeper_engine.runner.step_faults import FatalOnFailure, tensor_parallel_failure
from pagekeeper_engine.runner.step_inputs import StepInputs
from pagekeeper_engine.runner.step_results import LaunchedStep, PendingStep


class ModelRunner(RunnerSetup):
    """Runs scheduled steps of one model (or one rank's shard of it) on one device over a
    preallocated paged KV cache, as `RunnerSetup` left them."""

    @property
    def prefers_async_scheduling(self) -> bool:
        """Overlapping the host's work with the device's pays on CUDA (on the CPU the two are
        the same cores)."""
        return self.device.type == "cuda"

    def check_sampling(self, params: SamplingParams) -> None:
        """RequestRejectedError for parameters this runner cannot honour (a schema that does not
        compile), before the request runs."""
        assert self.sampler.grammar is not None
        self.sampler.grammar.check(params)

    @property
    def kv_load_seconds(self) -> float:
        """Device seconds the host tier's finished loads took."""
        return self.host_tier.load_seconds if self.host_tier is not None else 0.0

    @property
    def grammar_timings(self) -> GrammarTimings:
        """Where structured steps' grammar work spent the host's time (`GrammarMasks`)."""
        grammar = self.sampler.grammar
        return grammar.timings() if grammar is not None else GrammarTimings()

    @property
    def num_swap_ooms(self) -> int:
        """Swaps that ran out of device memory and fell back to a slow copy."""
        return self.pools.num_swap_ooms

    # -- one step ----------------------------------------------------------------------------

    def prepare_inputs(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """The step's packed inputs, as a launch builds them (`StepLauncher.prepare`)."""
        return self.steps.prepare(seqs)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply the step's swaps, run the forward pass, sample where asked, and wait.

        Out of device memory, it frees what the step allocated and raises
        DeviceOutOfMemoryError: the KV cache is as before the step (the scheduler retries it).
        """
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput) -> LaunchedStep | FatalOnFailure:
        """`execute` without the wait: the step is enqueued on the device (and handed to the
        other ranks first). Under tensor parallelism every failure of the step, here or while
        its tokens come back, ends the engine (`step_failure`)."""
        try:
            pending = self._launch(out)
        except FatalEngineError:
            raise
        except Exception as exc:
            if self.tp.size > 1:
                raise self.step_failure(exc) from exc
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            detail = str(exc)
        else:
            return pending if self.tp.size == 1 else FatalOnFailure(pending, self.step_failure)
        # Leaving the except block dropped the traceback, and with it the frames that held the
        # step's tensors; only now can their memory go back to the allocator and the device.
        self.release_cached_memory()
        raise DeviceOutOfMemoryError("step", detail)

    def follow(self, step: FollowerStep) -> PendingStep | FatalOnFailure:
        """A rank > 0 runs the step rank 0 packed (`follower_step.py`), without waiting; every
        failure is fatal, as every failure under tensor parallelism is."""
        try:
            self._issue_kv_copies(
                StepCopies(step.kv_loads, step.kv_stores, step.kv_fence, step.kv_late_loads)
            )
            self._faults.count()
            self.pools.swap(step.blocks_to_swap_out, to_cpu=True)
            self.pools.swap(step.blocks_to_swap_in, to_cpu=False)
            pending = self.steps.follow(step)
        except FatalEngineError:
            raise
        except Exception as exc:
            raise self.step_failure(exc) from exc
        return FatalOnFailure(pending, self.step_failure)

    def step_failure(self, exc: Exception) -> FatalEngineError:
        """What a failed step means under tensor parallelism (`step_faults`)."""
        return tensor_parallel_failure(self.tp.rank, self.followers, exc)

    def _issue_kv_copies(self, copies: StepCopies) -> None:
        """The host tier's copies of a step, before anything of the step can fail: the scheduler
        registered the loaded blocks already. A copy that cannot be issued leaves the prefix
        cache holding blocks it never filled, so it ends the engine."""
        if not (copies.loads or copies.stores or copies.late_loads or copies.fence):
            return
        assert self.host_tier is not None, "host tier copies without a host tier"
        try:
            self.host_tier.issue(copies)
        except Exception as exc:
            raise FatalEngineError(f"the host KV tier's copies failed: {exc}") from exc

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        self._issue_kv_copies(
            StepCopies(out.kv_loads, out.kv_stores, out.kv_fence, out.kv_late_loads)
        )
        # Rank 0 packs the step once and hands the bytes to the other ranks before running it.
        inputs = None
        if out.seqs:
            inputs = self.steps.prepare(out.seqs, keep_packed=self.followers is not None)
        if self.followers is not None:
            self.followers.send(follower_step(out, inputs))
        self._faults.count()
        self.pools.swap(out.blocks_to_swap_out, to_cpu=True)
        self.pools.swap(out.blocks_to_swap_in, to_cpu=False)
        if inputs is None:
            return PendingStep(0, [], None, None)
        return self.steps.run(inputs, out.seqs)
