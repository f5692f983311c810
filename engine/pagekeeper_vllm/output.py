"""What vLLM's output says about memory (pure): its out-of-memory errors and its readiness.

The launcher feeds every line vLLM prints (any process's: vLLM prefixes its children's lines,
so patterns are searched anywhere in a line). Recognised, from the texts vLLM 0.11 and 0.33 and
torch print:
- `CUDA out of memory. Tried to allocate` (torch's `OutOfMemoryError`): a GPU OOM, a start-up
  one if vLLM's server never said it was ready, a run-time one if it did (vLLM prints readiness
  and errors on different streams, so the order in which two pipes deliver them says nothing);
  torch's figures (tried to allocate, free of total, reserved but unallocated) are kept for the
  termination message;
- `No available memory for the cache blocks`: the KV cache got nothing (start-up);
- `... max seq len (N) ... is larger than the available KV cache memory`: the KV cache cannot
  hold one sequence of max-model-len (start-up).
Readiness is uvicorn's `Application startup complete`, which vLLM's API server prints once it
serves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

OOMPhase = Literal["startup", "runtime"]

READY_MARKER = "Application startup complete"
# Errors kept per run: the first ones say what happened; later ones repeat it on other ranks.
MAX_EVENTS = 16
_SIZE = r"[0-9.]+ [KMGTP]?i?B"
_CUDA_OOM = re.compile(
    r"CUDA out of memory\. (Tried to allocate|Allocation was preemptively rejected)"
)
_TRIED = re.compile(rf"Tried to allocate ({_SIZE})")
_CAPACITY = re.compile(rf"GPU (\d+) has a total capacity of ({_SIZE}) of which ({_SIZE}) is free")
_UNALLOCATED = re.compile(rf"({_SIZE}) is reserved by PyTorch but unallocated")
_NO_CACHE_MEMORY = re.compile(r"No available memory for the cache blocks")
_MAX_SEQ_LEN = re.compile(
    r"max seq len \((\d+)\).*?\(([0-9.]+) GiB KV cache is needed, which is larger than the "
    r"available KV cache memory \(([0-9.]+) GiB\)"
)
_ESTIMATED = re.compile(r"estimated maximum model length is (\d+)")


@dataclass(frozen=True)
class OOMEvent:
    """One out-of-memory error vLLM printed: a one-line account of it, and where."""

    detail: str
    line_number: int
    is_startup_only: bool  # the KV-cache errors, which only start-up raises


def _torch_oom_detail(line: str) -> str:
    parts = []
    if tried := _TRIED.search(line):
        parts.append(f"tried to allocate {tried[1]}")
    if capacity := _CAPACITY.search(line):
        parts.append(f"GPU {capacity[1]}: {capacity[3]} free of {capacity[2]}")
    if unallocated := _UNALLOCATED.search(line):
        parts.append(f"{unallocated[1]} reserved by PyTorch but unallocated")
    figures = f" ({'; '.join(parts)})" if parts else ""
    return f"vLLM: CUDA out of memory{figures}"


def classify_line(line: str) -> str | None:
    """The detail of the memory error `line` reports, or None."""
    if _CUDA_OOM.search(line):
        return _torch_oom_detail(line)
    if _NO_CACHE_MEMORY.search(line):
        return (
            "vLLM: no available memory for the KV cache blocks after loading and profiling "
            "(gpuMemoryUtilization too low for the model)"
        )
    if match := _MAX_SEQ_LEN.search(line):
        estimated = _ESTIMATED.search(line)
        fits = f"; about {estimated[1]} tokens would fit" if estimated else ""
        return (
            f"vLLM: the KV cache cannot hold one sequence of max-model-len {match[1]} "
            f"({match[2]} GiB needed, {match[3]} GiB available{fits})"
        )
    return None


@dataclass
class OutputWatcher:
    """Follows vLLM's output line by line: readiness and the memory errors, numbered by line."""

    is_ready: bool = False
    num_lines: int = 0
    events: list[OOMEvent] = field(default_factory=list)

    def feed_line(self, line: str) -> OOMEvent | None:
        self.num_lines += 1
        if not self.is_ready and READY_MARKER in line:
            self.is_ready = True
            return None
        detail = classify_line(line)
        if detail is None:
            return None
        event = OOMEvent(detail, self.num_lines, is_startup_only=not _CUDA_OOM.search(line))
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        return event

    def phase_of(self, event: OOMEvent) -> OOMPhase:
        """Start-up unless vLLM reached readiness and the error is one serving can raise."""
        return "runtime" if self.is_ready and not event.is_startup_only else "startup"

    def first_after(self, line_number: int) -> OOMEvent | None:
        """The first memory error printed after line `line_number` (0: the first of all)."""
        return next((e for e in self.events if e.line_number > line_number), None)


@dataclass
class LineSplitter:
    """Cuts one stream's chunks into lines at `\\n` or `\\r` (progress bars redraw with `\\r`)."""

    _partial: str = ""

    def feed(self, text: str) -> list[str]:
        *lines, self._partial = re.split(r"[\r\n]", self._partial + text)
        return [line for line in lines if line]

    def flush(self) -> list[str]:
        rest, self._partial = self._partial, ""
        return [rest] if rest else []
