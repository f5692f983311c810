"""What a failed step means under tensor parallelism: the engine ends.

The other ranks are inside the step's collectives (or past them), so no rank can fail a step
alone, or retry it, and go on: every failure of a step, at its launch or while its tokens come
back (a device error surfaces at the wait), becomes a `FatalEngineError`. On rank 0 a step that
failed because another rank ended names that rank's reason, which its `StepFollowers` learn,
rather than rank 0's own echo of the dropped connection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagekeeper_engine.core.outputs import RunnerOutput
from pagekeeper_engine.faults import FatalEngineError, RankFailedError, TensorParallelStepError
from pagekeeper_engine.memory.oom import EngineOutOfMemoryError
from pagekeeper_engine.runner.follower_step import FollowerStep
from pagekeeper_engine.runner.step_results import LaunchedStep

# How long a failed step on rank 0 waits to learn whether a peer's death caused it: a peer's
# dropped connection fails rank 0's collective a moment before the peer's exit can be seen.
PEER_FAILURE_WAIT_S = 2.0


class StepFollowers(Protocol):
    """The other tensor-parallel ranks, as rank 0 drives them."""

    def send(self, step: FollowerStep) -> None:
        """Hand them the step rank 0 is about to run."""
        ...

    def failure(self, timeout_s: float) -> RankFailedError | None:
        """The first of them that ended unasked, waiting up to `timeout_s` for one."""
        ...


def tensor_parallel_failure(
    rank: int, followers: StepFollowers | None, exc: Exception
) -> FatalEngineError:
    """The fatal error a failed step on `rank` becomes (see the module docstring)."""
    if followers is not None:
        cause = followers.failure(PEER_FAILURE_WAIT_S)
        if cause is not None:
            return cause
    if isinstance(exc, torch.OutOfMemoryError):
        return EngineOutOfMemoryError(
            f"tensor-parallel rank {rank} ran out of device memory in a step, which the other "
            f"ranks cannot retry with it: {exc}"
        )
    return TensorParallelStepError(
        f"tensor-parallel rank {rank}: a step failed ({type(exc).__name__}: {exc}); the other "
        "ranks cannot go on without it"
    )


@dataclass
class FatalOnFailure:
    """A tensor-parallel step on its way to the host: a failure to bring its tokens back ends
    the engine as a failure to launch it would."""

    pending: LaunchedStep
    to_fatal: Callable[[Exception], FatalEngineError]

    def result(self) -> RunnerOutput:
        try:
            return self.pending.result()
        except FatalEngineError:
            raise
        except Exception as exc:
            raise self.to_fatal(exc) from exc
