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
