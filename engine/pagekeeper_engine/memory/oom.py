"""Reporting an out-of-memory exit to the operator through the container's termination message.

The kubelet copies `/dev/termination-log` into `status.containerStatuses[].state.terminated
.message`; the operator classifies it (start-up vs run-time, GPU vs host) and steps the effective
policy down only after run-time GPU OOMs. One line, in the form the operator parses:

    pagekeeper-oom kind=<gpu|host> phase=<startup|runtime> detail=<free text to end of line>
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pagekeeper_engine.faults import FatalEngineError

logger = logging.getLogger(__name__)

TERMINATION_LOG = Path("/dev/termination-log")
# The kubelet keeps at most 4096 bytes of the message.
MAX_MESSAGE_BYTES = 4096

OOMKind = Literal["gpu", "host"]
OOMPhase = Literal["startup", "runtime"]


def termination_message(kind: OOMKind, phase: OOMPhase, detail: str) -> str:
    one_line = " ".join(detail.split())
    text = f"pagekeeper-oom kind={kind} phase={phase} detail={one_line}"
    return text.encode()[: MAX_MESSAGE_BYTES - 1].decode(errors="ignore") + "\n"


def write_termination_text(text: str, path: Path = TERMINATION_LOG) -> bool:
    """Write a failure's reason as the termination message (not an OOM: no `pagekeeper-oom`
    line, so the operator does not step the policy down); False (and a log line) where the
    file cannot be written."""
    one_line = " ".join(text.split())
    try:
        path.write_text(one_line.encode()[: MAX_MESSAGE_BYTES - 1].decode(errors="ignore") + "\n")
    except OSError as exc:
        logger.warning("could not write the termination message to %s: %s", path, exc)
        return False
    return True


def write_termination_log(
    kind: OOMKind, phase: OOMPhase, detail: str, path: Path = TERMINATION_LOG
) -> bool:
    """Write the classified reason; False (and a log line) where the file cannot be written."""
    try:
        path.write_text(termination_message(kind, phase, detail))
    except OSError as exc:
        logger.warning("could not write the termination message to %s: %s", path, exc)
        return False
    return True


# Kinds of out-of-memory event, as `pagekeeper_oom_events_total{kind}` counts them: inside a
# forward step (recovered by shrinking the step), while copying blocks to or from the swap pool
# (recovered by a copy that allocates nothing), and at start-up (the process exits).
OOM_EVENT_KINDS: tuple[str, ...] = ("step", "swap", "startup")


class DeviceOutOfMemoryError(RuntimeError):
    """The device ran out of memory inside one step; what the step allocated has been freed.

    Raised by the model runner in place of `torch.OutOfMemoryError`, so the step loop (which
    imports no torch) can tell it from other failures and recover.
    """

    def __init__(self, kind: str, detail: str) -> None:
        assert kind in OOM_EVENT_KINDS, kind
        super().__init__(detail)
        self.kind = kind


class EngineOutOfMemoryError(FatalEngineError):
    """Out-of-memory errors repeated past the retry limit, or one inside a tensor-parallel
    step: the engine gives up and exits."""

    is_out_of_memory = True
