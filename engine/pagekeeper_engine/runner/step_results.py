"""A launched step's sampled tokens on their way from the device to the host.

The runner leaves a step's sampled ids and log-probabilities on the device and copies them, in
one non-blocking copy, into one of two pinned host buffers; `PendingStep.result` waits for that
copy alone. The engine reads a step's result before it launches the step after next, so two
buffers, each with the event its copy records, suffice. The events are made once and recorded
on the device's current stream, named: at batch 1 the host's step is as long as the device's,
and asking torch for the current device on every record cost ~20 us of it
(docs/benchmarks-archive.md, "the batch-1 host step, as long as the device's").

A step holding a structured request is sampled later than it is launched (`step_launch`): it
is a `DeferredStep` until its sampling is enqueued, at the next launch or at its `result`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagekeeper_engine.core.outputs import RunnerOutput
from pagekeeper_engine.core.sampling_params import MAX_TOP_LOGPROBS


@dataclass
class PendingStep:
    """A launched step's sampled tokens on their way to the host."""

    num_seqs: int
    sampled_seqs: list[int]  # index into the step's seqs of each sampled row
    # (2 + 2K, N) float64: ids, log-probabilities, then K rows of the top alternatives' ids and
    # K of their log-probabilities (None: nothing sampled)
    host: torch.Tensor | None
    copied: torch.cuda.Event | None  # recorded after the copy into `host` (None: on the CPU)
    # sampled rows whose schema the vocabulary could not continue: cut, held to end-of-sequence
    cut_rows: list[int] = field(default_factory=list)

    def result(self) -> RunnerOutput:
        token_ids: list[int | None] = [None] * self.num_seqs
        logprobs: list[float | None] = [None] * self.num_seqs
        tops: list[list[tuple[int, float]] | None] | None = None
        if self.host is not None:
            if self.copied is not None:
                self.copied.synchronize()
            token_col, logprob_col, *top_rows = self.host.tolist()
            for row, i in enumerate(self.sampled_seqs):
                token_ids[i] = int(token_col[row])
                logprobs[i] = logprob_col[row]
            if top_rows:
                tops = [None] * self.num_seqs
                num_top = len(top_rows) // 2
                for row, i in enumerate(self.sampled_seqs):
                    tops[i] = [
                        (int(top_rows[k][row]), top_rows[num_top + k][row]) for k in range(num_top)
                    ]
        cut_seqs = [self.sampled_seqs[row] for row in self.cut_rows]
        return RunnerOutput(
            sampled_token_ids=token_ids, logprobs=logprobs, top_logprobs=tops, cut_seqs=cut_seqs
        )


class DeferredStep:
    """A launched step whose sampling is still to be enqueued, by `sample` (called at most once
    by whichever comes first: the next launch or this step's `result`); a failure to sample it
    is raised again to every later caller."""

    def __init__(self, sample: Callable[[], PendingStep]) -> None:
        self._sample: Callable[[], PendingStep] | None = sample
        self._sampled: PendingStep | None = None
        self._error: Exception | None = None

    def sampled(self) -> PendingStep:
        if self._sample is not None:
            sample, self._sample = self._sample, None
            try:
                self._sampled = sample()
            except Exception as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        assert self._sampled is not None
        return self._sampled

    def result(self) -> RunnerOutput:
        return self.sampled().result()


LaunchedStep = PendingStep | DeferredStep


class HostResultBuffers:
    """Two pinned host buffers of `max_rows` rows' results (an id, its log-probability, and
    room for `MAX_TOP_LOGPROBS` alternatives), used in turn."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        is_cuda = device.type == "cuda"
        # flat, so that a step's (2, N) view of one is contiguous (a strided destination
        # would make the copy synchronous)
        self._buffers = [
            torch.empty(
                (2 + 2 * MAX_TOP_LOGPROBS) * max_rows, dtype=torch.float64, pin_memory=is_cuda
            )
            for _ in range(2)
        ]
        self._events = [
            torch.cuda.Event()  # type: ignore[no-untyped-call]
            for _ in range(2 if is_cuda else 0)
        ]
        self._num_launched = 0

    def send(self, num_seqs: int, sampled_seqs: list[int], packed: torch.Tensor) -> PendingStep:
        """Start copying `packed` (2 + 2K, N) to the host; the step's PendingStep."""
        num_planes, num_rows = packed.shape
        if self.device.type != "cuda":
            return PendingStep(num_seqs, sampled_seqs, packed, None)
        turn = self._num_launched % 2
        flat = self._buffers[turn]
        if num_planes * num_rows > flat.numel():  # more rows than sequences may run
            return PendingStep(num_seqs, sampled_seqs, packed.cpu(), None)
        buffer = flat[: num_planes * num_rows].view(num_planes, num_rows)
        self._num_launched += 1
        buffer.copy_(packed, non_blocking=True)
        copied = self._events[turn]
        copied.record(torch.cuda.current_stream(self.device))
        return PendingStep(num_seqs, sampled_seqs, buffer, copied)
