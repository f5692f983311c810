"""Out of device memory inside a step: shrink the step, preempt what it cannot serve, retry.

Pure Python; never imports torch. When the runner raises `DeviceOutOfMemoryError` it has freed
what the step allocated, and the scheduler's state is as before the step (no token was
computed), so the step loop does not fail the step's requests: `OomRecovery.on_oom` halves the
step's token budget (`memory.step_budget`), preempts for recompute the running sequences of the
step that the smaller budget cannot serve, newest first, and the loop schedules again. Only after
`max_consecutive_ooms` such errors with no clean step between them does it give up
(`EngineOutOfMemoryError`: the engine cannot serve at any step size and must restart).
"""

from __future__ import annotations

import logging

from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.memory.oom import (
    OOM_EVENT_KINDS,
    DeviceOutOfMemoryError,
    EngineOutOfMemoryError,
)
from pagekeeper_engine.memory.step_budget import StepTokenBudget

logger = logging.getLogger(__name__)


class OomRecovery:
    """The live step token budget of one scheduler and the out-of-memory events that move it.

    The scheduler reads its step budget in `check_request` too (without chunked prefill a prompt
    must fit one step); requests are checked on the step loop's own thread, outside `schedule`,
    so they meet the configured budget, never a reduced one.
    """

    def __init__(self, scheduler: Scheduler, max_consecutive_ooms: int) -> None:
        self.scheduler = scheduler
        self.budget = StepTokenBudget(scheduler.max_num_batched_tokens)
        self.max_consecutive_ooms = max_consecutive_ooms
        self.num_events = dict.fromkeys(OOM_EVENT_KINDS, 0)
        self._num_swap_ooms_seen = 0

    def check_request(self, num_prompt_tokens: int) -> None:
        """`Scheduler.check_request` against the configured step budget."""
        self.scheduler.check_request(num_prompt_tokens)

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, within the budget as it stands now."""
        budget = self.budget
        if not budget.is_reduced:
            return self.scheduler.schedule()
        self.scheduler.max_num_batched_tokens = budget.current
        try:
            return self.scheduler.schedule()
        finally:
            self.scheduler.max_num_batched_tokens = budget.ceiling

    def on_empty_step(self) -> None:
        """Nothing was scheduled: if work waits, nothing fits the reduced budget (a prompt
        without chunked prefill, say), so the budget goes back to its ceiling."""
        if self.budget.is_reduced and self.scheduler.has_work():
            self.budget.restore()

    def on_clean_step(self) -> None:
        self.budget.on_clean_step()

    def count_swap_ooms(self, num_swap_ooms: int) -> None:
        """Book the runner's swap OOMs (`num_swap_ooms`: its running total) not booked yet."""
        num_new = num_swap_ooms - self._num_swap_ooms_seen
        if num_new:
            self._num_swap_ooms_seen += num_new
            self.num_events["swap"] += num_new

    def on_oom(self, out: SchedulerOutput, exc: DeviceOutOfMemoryError) -> None:
        """Shrink the step, preempt what the smaller step cannot serve; the loop retries next
        step. Raises EngineOutOfMemoryError past `max_consecutive_ooms` in a row."""
        self.num_events[exc.kind] += 1
        failed_budget = self.budget.current
        new_budget = self.budget.on_oom()
        num_in_a_row = self.budget.num_consecutive_ooms
        if num_in_a_row > self.max_consecutive_ooms:
            raise EngineOutOfMemoryError(
                f"{num_in_a_row} out-of-memory errors in a row, the last at a step of "
                f"{out.num_batched_tokens} tokens ({len(out.seqs)} sequences) within a step "
                f"budget of {failed_budget} of {self.budget.ceiling} tokens: {exc}"
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
                sched.preempt_for_recompute(seq)
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
