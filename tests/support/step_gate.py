"""A gate on the paged engine's steps, so that a test, not the machine's speed, decides how far
the engine's requests get.

`python -m tests.support.step_gate serve MODEL [flags]` is `pagekeeper-engine serve` whose engine
core takes a step (`LLMEngine.step`) only while the file named by `STEP_GATE_ENV` allows one
more: the file holds how many steps the core may take in all since it started, or `open`. A
turn the gate refuses takes no step, but the loop still turns: it reads its messages (aborts
included), sends its stats (so /health stays green and /metrics current) and marks the turn
for the progress watchdog. A request the gate holds therefore stays exactly where it is, with
the tokens of the steps allowed so far, until the test moves the gate.

The core runs in a process of its own (spawned), so the gate wraps that process's target, and
the wrapper installs it there before the engine loads.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagekeeper_engine.messages import EngineOutput

STEP_GATE_ENV = "PAGEKEEPER_TEST_STEP_GATE"
OPEN = "open"
# How long a refused turn waits before the loop turns again and reads the gate anew: the pace
# of that polling, not a wait for anything.
REFUSED_TURN_S = 0.01
MODULE = "tests.support.step_gate"  # run with `python -m`


@dataclass
class StepGate:
    """The test's side of the gate file."""

    path: Path

    def allow(self, num_steps: int) -> None:
        """The core may take `num_steps` steps in all, counted from its start."""
        assert num_steps >= 0, f"num_steps {num_steps} < 0"
        self._write(str(num_steps))

    def open(self) -> None:
        """Every step from now on (for good: the core stops reading the file)."""
        self._write(OPEN)

    def _write(self, text: str) -> None:
        staged = self.path.with_name(self.path.name + ".new")
        staged.write_text(text)
        os.replace(staged, self.path)  # the core never reads half a write


def install(path: Path) -> None:
    """Put `LLMEngine.step` behind the gate at `path`, in this process."""
    from pagekeeper_engine.loop.engine import LLMEngine  # noqa: PLC0415

    step = LLMEngine.step
    num_taken = 0
    is_open = False

    def gated_step(engine: LLMEngine) -> list[EngineOutput]:
        nonlocal num_taken, is_open
        if not is_open:
            text = path.read_text().strip()
            is_open = text == OPEN
            if not is_open and num_taken >= int(text):
                time.sleep(REFUSED_TURN_S)
                return []
        num_taken += 1
        return step(engine)

    LLMEngine.step = gated_step  # type: ignore[method-assign,assignment]


def run_gated_engine_core(*args: Any) -> None:
    """The engine core process's target (`engine_process.run_engine_core`), behind the gate."""
    from pagekeeper_engine.engine_process import run_engine_core  # noqa: PLC0415

    path = os.environ.get(STEP_GATE_ENV)
    assert path, f"{STEP_GATE_ENV} names no gate file"
    install(Path(path))
    run_engine_core(*args)


if __name__ == "__main__":
    from pagekeeper_engine import cli

    # `serve` starts the core with the target it finds here when it runs (a spawned process
    # finds this function in this module, which multiprocessing imports there as __mp_main__).
    cli.run_engine_core = run_gated_engine_core  # type: ignore[attr-defined,assignment]
    sys.exit(cli.main())
