"""Incremental detokenization, stop strings, and the hold-back of text that may begin one.

Pure Python. The front end keeps one `TextState` per request. For each step message from the
core, `detokenize_next` decodes every request's new tokens into its `output_text` (one
tokenizer call for the whole message), `cut_at_stop_string` cuts the text at a stop string that
ends in the new text, and `take_new_text` hands the client only the text that can no longer
become the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagekeeper_engine.core.sampling_params import SamplingParams

DecodeBatch = Callable[[list[list[int]]], list[str]]
# Prompt tokens decoded before the first output token, so that token decodes with its leading
# space (tokenizers strip it when a token starts the decoded text).
NUM_CONTEXT_TOKENS = 5


@dataclass
class TextState:
    """One request's text so far: the token ids it decodes from (a few prompt tokens, then the
    outputs), the window offsets into them, the text, and how much of it was handed out."""

    params: SamplingParams
    token_ids: list[int]
    prefix_offset: int = 0
    read_offset: int = 0
    num_output_tokens: int = 0
    output_text: str = ""
    num_text_emitted: int = 0

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], params: SamplingParams) -> TextState:
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        return cls(params, context, prefix_offset=0, read_offset=len(context))

    def append(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.num_output_tokens += len(token_ids)


def detokenize_next(decode_batch: DecodeBatch, states: list[TextState]) -> list[int]:
    """Append the text of each state's undecoded tokens to its `output_text`; returns the
    lengths of the texts before.

    Decodes a short window (`prefix_offset:`) rather than the whole output, and the window
    without the new tokens (`prefix_offset:read_offset`), taking the difference: tokens merge
    across boundaries (leading spaces, multi-byte characters). A window ending in U+FFFD is an
    incomplete UTF-8 sequence: wait for the next token. Both windows of every state go to the
    tokenizer in one call.
    """
    if not states:
        return []
    windows = []
    for state in states:
        ids = state.token_ids
        windows.append(ids[state.prefix_offset : state.read_offset])
        windows.append(ids[state.prefix_offset :])
    texts = decode_batch(windows)
    old_lengths = []
    for index, state in enumerate(states):
        prefix_text, full_text = texts[2 * index], texts[2 * index + 1]
        old_lengths.append(len(state.output_text))
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            state.output_text += full_text[len(prefix_text) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.token_ids)
    return old_lengths


def find_stop_string(text: str, stops: tuple[str, ...], num_old_chars: int) -> int | None:
    """Where the earliest stop string that ends in the new text begins, or None."""
    cuts = []
    for stop in stops:
        if not stop:
            continue
        start = max(0, num_old_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            cuts.append(index)
    return min(cuts, default=None)


def cut_at_stop_string(state: TextState, num_old_chars: int) -> bool:
    """Cut `state.output_text` at the earliest stop string that ends in its text past
    `num_old_chars` (once `min_tokens` are out); whether one did."""
    params = state.params
    if not params.stop or state.num_output_tokens < params.min_tokens:
        return False
    cut = find_stop_string(state.output_text, params.stop, num_old_chars)
    if cut is None:
        return False
    state.output_text = state.output_text[:cut]
    return True


def take_new_text(state: TextState, is_finished: bool) -> str:
    """The text not yet handed out; all of it once finished, else all but what may still
    become the start of a stop string (which stays back)."""
    if is_finished:
        num_visible = len(state.output_text)
    else:
        num_held = max((len(s) for s in state.params.stop), default=1) - 1
        num_visible = max(state.num_text_emitted, len(state.output_text) - num_held)
    new_text = state.output_text[state.num_text_emitted : num_visible]
    state.num_text_emitted = num_visible
    return new_text
