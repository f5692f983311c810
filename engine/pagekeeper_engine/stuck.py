"""Reporting a stuck engine to the operator through the container's termination message.

Both runtimes end a pod whose engine stopped making progress with work in hand: the paged
engine's progress watchdog (`progress_watch`) and the vLLM launcher's probe (`pagekeeper_vllm
.probe`). Each writes one line, in the form the operator parses (and mirrors as `STUCK_LINE`):

    pagekeeper-stuck last_step_age_s=<seconds> running=<n> waiting=<n> detail=<free text>

`last_step_age_s` is how long ago the engine last made progress (a completed step; for vLLM, a
generated token or an answered /health), with one decimal; `running` and `waiting` are the
requests in flight when it was found. The operator counts a `stuck` termination like an
out-of-memory one for the canary and the remediation history, but never steps memory down for
it. Standard library only: the vLLM launcher imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pagekeeper_engine.memory.oom import MAX_MESSAGE_BYTES, TERMINATION_LOG, write_termination_text

STUCK_PREFIX = "pagekeeper-stuck"
STUCK_LINE = re.compile(
    r"^pagekeeper-stuck last_step_age_s=(?P<age>\d+(?:\.\d+)?) running=(?P<running>\d+) "
    r"waiting=(?P<waiting>\d+) detail=(?P<detail>.*)$"
)


@dataclass(frozen=True)
class StuckReport:
    """An engine found making no progress: how long since it last did, what it held, and why."""

    last_step_age_s: float
    num_running: int
    num_waiting: int
    detail: str

    def message(self) -> str:
        """The termination message: one line (newline-terminated) within the kubelet's bound."""
        assert self.last_step_age_s >= 0, self.last_step_age_s
        assert self.num_running >= 0 and self.num_waiting >= 0, (self.num_running, self.num_waiting)
        detail = " ".join(self.detail.split())
        text = (
            f"{STUCK_PREFIX} last_step_age_s={self.last_step_age_s:.1f} "
            f"running={self.num_running} waiting={self.num_waiting} detail={detail}"
        )
        return text.encode()[: MAX_MESSAGE_BYTES - 1].decode(errors="ignore") + "\n"


def parse_stuck_message(text: str) -> StuckReport | None:
    """The report a termination message carries; None where it is not a stuck line."""
    match = STUCK_LINE.match(text.strip())
    if match is None:
        return None
    return StuckReport(
        float(match["age"]), int(match["running"]), int(match["waiting"]), match["detail"]
    )


def write_stuck_message(report: StuckReport, path: Path = TERMINATION_LOG) -> bool:
    """Write the report as the termination message; False (and a log line) where it cannot."""
    return write_termination_text(report.message(), path)
