"""One step's grammar work on the host: each structured row's matcher takes the tokens it has
not seen yet, then the rows' next-token bitmasks are filled (`fill_step_masks`).

It runs on the grammar thread (`structured_output.GrammarMasks`), never on the thread that
schedules and launches steps. Everything it reads was fixed when the step was launched
(`FillJob`): the rows, their matchers, how many output tokens each row had then, and its newest
token, which is read from the host copy the launch started (waiting for the step that sampled
it, not for this step's forward pass). Older tokens are read from the sequence's own list;
the step loop only appends to it or fills its newest entry, so the entries read here are
already final.

A bitmask row is `ceil(V / 32)` int32 words, token t at bit t % 32 of word t // 32; a row of all
ones (-1) allows every token, which is what the rows without a schema get.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagekeeper_engine.runner.grammar_timing import FillTimes

logger = logging.getLogger(__name__)


@dataclass
class MatcherState:
    """A request's matcher and how many of its output tokens it has taken; `is_stuck` once its
    schema can go no further, `is_terminated` once it took an end-of-sequence token (either
    way the row is then held to the end-of-sequence tokens). Termination is tracked here, from
    the end token the row took, rather than asked of every matcher at every step."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    is_stuck: bool = False
    is_terminated: bool = False


@dataclass(frozen=True)
class FillJob:
    """What a launch fixed for its step's grammar work."""

    host: torch.Tensor  # (N, W) int32: this step's rows of a pinned host bitmask
    rows: list[int]  # the structured rows
    states: list[MatcherState]  # their matchers, in `rows` order
    token_lists: list[list[int]]  # their sequences' token lists (prompt then outputs)
    num_prompt_tokens: list[int]
    num_output_tokens: list[int]  # at the launch; the newest of them may be pending
    newest_token_ids: Callable[[], list[int]]  # (N,) every row's newest token, read on the host


@functools.cache
def _filled_rows(row_bytes: int) -> tuple[bytes, bytes]:
    """A row of zero bits and a row of one bits, `row_bytes` long (one vocabulary's)."""
    return bytes(row_bytes), b"\xff" * row_bytes


class HostRows:
    """A step's rows of the pinned host bitmask, written and read without letting the GIL go:
    a row is set as one slice of a memoryview over its bytes (one memcpy inside the
    interpreter) and compared as a copy of that slice (one memcpy, one memcmp), single words
    through numpy scalars. torch's and numpy's ops over rows this long let the GIL go (see
    `fill_step_masks`)."""

    def __init__(self, host: torch.Tensor) -> None:  # (N, W) int32, contiguous
        assert host.is_contiguous() and host.dtype == torch.int32, (host.dtype, host.stride())
        self.words = host.numpy().view(np.uint32)  # (N, W): the same bytes
        self.row_bytes = 4 * host.shape[1]
        self._bytes = self.words.data.cast("B")
        self._zeros, self._ones = _filled_rows(self.row_bytes)

    def _row(self, row: int) -> slice:
        return slice(row * self.row_bytes, (row + 1) * self.row_bytes)

    def allow_all(self, row: int) -> None:
        self._bytes[self._row(row)] = self._ones

    def allow_only(self, row: int, token_ids: frozenset[int]) -> None:
        self._bytes[self._row(row)] = self._zeros
        for token_id in token_ids:
            self.words[row, token_id >> 5] |= np.uint32(1 << (token_id & 31))

    def allows_any(self, row: int) -> bool:
        """Whether some bit of the row is set."""
        return self._bytes[self._row(row)].tobytes() != self._zeros  # a copy, then memcmp


def _take_new_tokens(job: FillJob, newest: list[int], eos_token_ids: frozenset[int]) -> None:
    """Every structured row's matcher takes the outputs it has not seen: one token a step as a
    rule (in one batch call), more after a preemption recomputed a sequence. A matcher that
    takes an end-of-sequence token has terminated (xgrammar ends a match only on one)."""
    import xgrammar  # noqa: PLC0415

    single: list[MatcherState] = []
    single_ids: list[int] = []
    for row, state, tokens, num_prompt, num_outputs in zip(
        job.rows,
        job.states,
        job.token_lists,
        job.num_prompt_tokens,
        job.num_output_tokens,
        strict=True,
    ):
        pending = range(state.num_accepted, num_outputs)
        state.num_accepted = max(state.num_accepted, num_outputs)
        if state.is_stuck or state.is_terminated or not pending:
            continue
        if len(pending) == 1:
            single.append(state)
            single_ids.append(newest[row])
            continue
        for index in pending:
            token_id = newest[row] if index == num_outputs - 1 else tokens[num_prompt + index]
            if not _took(state, token_id, state.matcher.accept_token(token_id), eos_token_ids):
                break
    if single:
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token(
            [s.matcher for s in single], single_ids
        )
        for state, token_id, is_accepted in zip(single, single_ids, accepted, strict=True):
            _took(state, token_id, is_accepted, eos_token_ids)


def _took(
    state: MatcherState, token_id: int, is_accepted: bool, eos_token_ids: frozenset[int]
) -> bool:
    """Record whether the matcher took `token_id`; False once it can go no further."""
    if not is_accepted:
        logger.error("token %d does not continue its schema; ending the reply", token_id)
        state.is_stuck = True
        return False
    if token_id in eos_token_ids:
        state.is_terminated = True
        return False
    return True


def fill_step_masks(
    job: FillJob,
    batch: Any,  # an xgrammar.BatchGrammarMatcher
    eos_token_ids: frozenset[int],
    times: FillTimes | None = None,  # marks its moments here (`grammar_timing`)
) -> list[int]:
    """Fill `job.host`: the structured rows' masks, all ones elsewhere. Returns the rows cut
    mid-way: rows whose schema this vocabulary cannot continue (or that took a token it does
    not allow), held to the end-of-sequence tokens from here.

    This thread shares the GIL with the step loop's, which runs Python most of the time: each
    call that lets the GIL go can cost up to the interpreter's switch interval to get it back.
    So the calls that let it go are the same two however many rows: xgrammar's batch accept
    and batch fill (where the work is). Every other row is written, and every row checked,
    through `HostRows`, which keeps it."""
    newest = job.newest_token_ids() if job.rows else []
    if times is not None:
        times.ids_on_host = time.perf_counter()
    _take_new_tokens(job, newest, eos_token_ids)
    if times is not None:
        times.accepted = time.perf_counter()
    rows = HostRows(job.host)
    live_rows: list[int] = []
    live: list[MatcherState] = []
    cut_rows: list[int] = []
    structured = set(job.rows)
    for row in range(job.host.shape[0]):
        if row not in structured:
            rows.allow_all(row)
    for row, state in zip(job.rows, job.states, strict=True):
        if state.is_stuck or state.is_terminated:
            # terminated: it took an end token the step loop has not stopped on yet
            if state.is_stuck:
                cut_rows.append(row)
            rows.allow_only(row, eos_token_ids)
        else:
            live_rows.append(row)
            live.append(state)
    if live:
        matchers = [s.matcher for s in live]
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, job.host, live_rows)
        if times is not None:
            times.bitmask_seconds = time.perf_counter() - started
            times.bitmask_rows = len(live)
        for row, state in zip(live_rows, live, strict=True):
            if not rows.allows_any(row):  # the vocabulary cannot spell what must come next
                state.is_stuck = True
                cut_rows.append(row)
                rows.allow_only(row, eos_token_ids)
    return sorted(cut_rows)
