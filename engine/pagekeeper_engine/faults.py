"""Errors the engine cannot go on from, and the hook that injects one where tests need it.

`FatalEngineError` is never caught by a step-level handler: the step loop re-raises it, the
engine core tells every front end (`Fatal`), writes the termination message and exits 1, and
the front ends stop. Under tensor parallelism every failure of a step is fatal: the other ranks
are inside that step's collectives, so no rank can fail the step alone and go on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# "<rank>:<step>": that tensor-parallel rank (0 without tensor parallelism) raises in its
# <step>-th launched step, counting from 1. For the fault tests only; unset in production.
INJECT_STEP_FAULT_ENV = "PAGEKEEPER_INJECT_STEP_FAULT"
# "<rank>:<step>": that rank's <step>-th launched step never returns (`StepFaultInjection.hang`).
INJECT_STEP_HANG_ENV = "PAGEKEEPER_INJECT_STEP_HANG"


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


def injected_fault_step(
    rank: int, env: Mapping[str, str], variable: str = INJECT_STEP_FAULT_ENV
) -> int | None:
    """The step at which `rank` must fail (or hang, with `variable` = `INJECT_STEP_HANG_ENV`),
    or None; ValueError naming the variable if malformed."""
    text = env.get(variable, "").strip()
    if not text:
        return None
    fault_rank, sep, step = text.partition(":")
    if not sep or not fault_rank.isdigit() or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{variable}={text!r}: expected <rank>:<step>, step >= 1")
    return int(step) if int(fault_rank) == rank else None


def wait_forever() -> None:
    """Block this thread for good, as a step stuck in a collective does (the GIL released, so
    the process's other threads run on)."""
    threading.Event().wait()


@dataclass
class StepFaultInjection:
    """Counts one rank's launched steps, fails the one `INJECT_STEP_FAULT_ENV` names and hangs
    in the one `INJECT_STEP_HANG_ENV` names (through `hang`: the runner's device may hang its
    own way)."""

    rank: int
    fault_step: int | None  # `injected_fault_step`
    hang_step: int | None = None
    hang: Callable[[], None] = field(default=wait_forever, repr=False)
    launched: int = 0

    def count(self) -> None:
        """One more step launched; InjectedStepFaultError at the named one, no return from the
        hanging one."""
        self.launched += 1
        if self.launched == self.hang_step:
            self.hang()
        if self.launched == self.fault_step:
            raise InjectedStepFaultError(
                f"rank {self.rank}: fault injected in step {self.launched} "
                f"({INJECT_STEP_FAULT_ENV})"
            )
