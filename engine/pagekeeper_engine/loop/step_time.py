"""Where the step loop's thread spends its steps (`StepHostSeconds`).

With asynchronous scheduling the host's work on step N+1 hides behind the device's work on step
N only while it is shorter. `wait` is the host idle for the device: near 0 under load, the
host sets the pace, and the other parts say which of its work to cut. The synchronous loop
waits inside the runner's `execute`, so there `launch` holds the device's step and `wait` and
`book` stay 0.

Imports no torch: the loop reads one clock (`LLMEngine`'s) around each part.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepHostSeconds:
    """Seconds summed over the loop's steps, by part, in the order a step takes them:
    - `schedule`: the scheduler picks the step (admission, preemption, the KV blocks);
    - `launch`: the runner packs the inputs and enqueues the forward pass and the sampling;
    - `book`: the scheduler books the launched step's tokens as placeholders;
    - `wait`: blocked on the device for a launched step's tokens;
    - `apply`: those tokens applied (placeholders filled, stop checks, finished requests
      freed, the outputs built)."""

    schedule: float = 0.0
    launch: float = 0.0
    book: float = 0.0
    wait: float = 0.0
    apply: float = 0.0

    def copy(self) -> StepHostSeconds:
        return StepHostSeconds(**self.as_dict())

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def since(self, earlier: StepHostSeconds) -> StepHostSeconds:
        """What each part gained after `earlier` (a `copy` of these taken before)."""
        now, then = self.as_dict(), earlier.as_dict()
        return StepHostSeconds(**{name: now[name] - then[name] for name in now})
