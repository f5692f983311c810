"""Errors the engine cannot go on from, and the hook that injects one where tests need it.

`FatalEngineError` is never caught by a step-level handler: the step loop re-raises it, the
engine core tells every front end (`Fatal`), writes the termination message and exits 1, and
the front ends stop. Under tensor parallelism every failure of a step is fatal: the other ranks
are inside that step's collectives, so no rank can fail the step alone and go on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# "<rank>:<step>": that tensor-parallel rank (0 without tensor parallelism) raises in its
# <step>-th launched step, counting from 1. For the fault tests only; unset in production.
INJECT_STEP_FAULT_ENV = "PAGEKEEPER_INJECT_STEP_FAULT"


class FatalEngineError(RuntimeError):
    """The engine cannot serve any longer; it must exit and be restarted."""

    is_out_of_memory = False


class TensorParallelStepError(FatalEngineError):
    """A step failed on one tensor-parallel rank."""


class RankFailedError(FatalEngineError):
    """Another tensor-parallel rank ended while the engine ran, which no rank can go on without.

    `wrote_termination_message`: that rank said why in the termination message before it
    exited, and no other rank may overwrite it.
    """

    def __init__(self, reason: str, *, wrote_termination_message: bool = False) -> None:
        super().__init__(reason)
        self.wrote_termination_message = wrote_termination_message


class InjectedStepFaultError(RuntimeError):
    """The failure `INJECT_STEP_FAULT_ENV` asks for (an ordinary step failure by itself)."""


def injected_fault_step(rank: int, env: Mapping[str, str]) -> int | None:
    """The step at which `rank` must fail, or None; ValueError naming the variable if malformed."""
    text = env.get(INJECT_STEP_FAULT_ENV, "").strip()
    if not text:
        return None
    fault_rank, sep, step = text.partition(":")
    if not sep or not fault_rank.isdigit() or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{INJECT_STEP_FAULT_ENV}={text!r}: expected <rank>:<step>, step >= 1")
    return int(step) if int(fault_rank) == rank else None


@dataclass
class StepFaultInjection:
    """Counts one rank's launched steps and fails the one `INJECT_STEP_FAULT_ENV` names."""

    rank: int
    fault_step: int | None  # `injected_fault_step`
    launched: int = 0

    def count(self) -> None:
        """One more step launched; InjectedStepFaultError at the named one."""
        self.launched += 1
        if self.launched == self.fault_step:
            raise InjectedStepFaultError(
                f"rank {self.rank}: fault injected in step {self.launched} "
                f"({INJECT_STEP_FAULT_ENV})"
            )
