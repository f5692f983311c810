"""The step's token budget under out-of-memory pressure: halve on each OOM, grow back slowly.

Pure. A step that runs out of device memory is retried with half the tokens (never below a
floor); after `restore_after` clean steps in a row the budget doubles, up to the configured
`--max-num-batched-tokens`. `num_consecutive_ooms` counts OOMs with no clean step between them;
the engine gives up when it passes its limit.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_STEP_TOKEN_BUDGET = 16  # one decode row per sequence of a small batch still fits
RESTORE_AFTER_CLEAN_STEPS = 64


@dataclass
class StepTokenBudget:
    """The live token budget of one step, between `floor` and `ceiling` (the configured one)."""

    ceiling: int
    floor: int = MIN_STEP_TOKEN_BUDGET
    restore_after: int = RESTORE_AFTER_CLEAN_STEPS
    current: int = 0
    num_clean_steps: int = 0
    num_consecutive_ooms: int = 0

    def __post_init__(self) -> None:
        assert self.ceiling >= 1 and self.restore_after >= 1, (self.ceiling, self.restore_after)
        self.floor = min(self.floor, self.ceiling)
        if self.current == 0:
            self.current = self.ceiling

    @property
    def is_reduced(self) -> bool:
        return self.current < self.ceiling

    def on_oom(self) -> int:
        """Halve the budget (not below the floor); the new budget."""
        self.num_consecutive_ooms += 1
        self.num_clean_steps = 0
        self.current = max(self.current // 2, self.floor)
        return self.current

    def on_clean_step(self) -> int:
        """A step ran: after `restore_after` in a row, double the budget toward the ceiling."""
        self.num_consecutive_ooms = 0
        if not self.is_reduced:
            return self.current
        self.num_clean_steps += 1
        if self.num_clean_steps >= self.restore_after:
            self.num_clean_steps = 0
            self.current = min(self.current * 2, self.ceiling)
        return self.current

    def restore(self) -> None:
        """Back to the ceiling at once: nothing could run within the reduced budget."""
        self.current = self.ceiling
        self.num_clean_steps = 0
