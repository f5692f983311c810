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

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class MatcherState:
    """A request's matcher and how many of its output tokens it has taken; `is_stuck` once its
    schema can go no further (the row is then held to the end-of-sequence tokens)."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    is_stuck: bool = False


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


def allow_only(mask_row: torch.Tensor, token_ids: frozenset[int]) -> None:
    """A bitmask row allowing only `token_ids`."""
    mask_row.zero_()
    for token_id in token_ids:
        word = token_id // 32
        bits = (int(mask_row[word]) & 0xFFFFFFFF) | (1 << (token_id % 32))
        mask_row[word] = bits - (1 << 32) if bits >= 1 << 31 else bits


def _take_new_tokens(job: FillJob, newest: list[int]) -> None:
    """Every structured row's matcher takes the outputs it has not seen: one token a step as a
    rule (in one batch call), more after a preemption recomputed a sequence."""
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
        if state.is_stuck or not pending:
            continue
        if len(pending) == 1:
            single.append(state)
            single_ids.append(newest[row])
            continue
        for index in pending:
            token_id = newest[row] if index == num_outputs - 1 else tokens[num_prompt + index]
            if not state.matcher.accept_token(token_id):
                logger.error("token %d does not continue its schema; ending the reply", token_id)
                state.is_stuck = True
                break
    if single:
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token(
            [s.matcher for s in single], single_ids
        )
        for state, token_id, is_accepted in zip(single, single_ids, accepted, strict=True):
            if not is_accepted:
                logger.error("token %d does not continue its schema; ending the reply", token_id)
                state.is_stuck = True


def fill_step_masks(
    job: FillJob, batch: Any, eos_token_ids: frozenset[int]
) -> list[int]:  # `batch`: an xgrammar.BatchGrammarMatcher
    """Fill `job.host`: the structured rows' masks, all ones elsewhere. Returns the rows cut
    mid-way: rows whose schema this vocabulary cannot continue (or that took a token it does
    not allow), held to the end-of-sequence tokens from here."""
    newest = job.newest_token_ids() if job.rows else []
    _take_new_tokens(job, newest)
    job.host.fill_(-1)
    live_rows: list[int] = []
    live: list[MatcherState] = []
    cut_rows: list[int] = []
    for row, state in zip(job.rows, job.states, strict=True):
        was_stuck = state.is_stuck
        if state.is_stuck or state.matcher.is_terminated():
            # terminated: it took an end token the step loop has not stopped on yet
            if was_stuck:
                cut_rows.append(row)
            allow_only(job.host[row], eos_token_ids)
        else:
            live_rows.append(row)
            live.append(state)
    if live:
        batch.batch_fill_next_token_bitmask([s.matcher for s in live], job.host, live_rows)
        allows_any = job.host[live_rows].any(dim=1).tolist()
        for row, state, any_allowed in zip(live_rows, live, allows_any, strict=True):
            if not any_allowed:  # the vocabulary cannot spell what must come next
                state.is_stuck = True
                cut_rows.append(row)
                allow_only(job.host[row], eos_token_ids)
    return sorted(cut_rows)
