"""Incremental detokenization, stop strings, and the hold-back of text that may begin one.

Pure Python; never imports torch. The step loop decodes each sequence's newest token into its
`output_text` (`detokenize_next`, one tokenizer call for the whole step), cuts the text at a stop
string that ends in the new text (`cut_at_stop_string`), and hands the client only the text that
can no longer become the start of a stop string (`take_new_text`).
"""

from __future__ import annotations

from collections.abc import Callable

from pagekeeper_engine.core.sequence import Sequence

DecodeBatch = Callable[[list[list[int]]], list[str]]


def detokenize_next(decode_batch: DecodeBatch, seqs: list[Sequence]) -> list[int]:
    """Append each sequence's newest known token's text to its `output_text`; returns the
    lengths of the texts before.

    Decodes a short window (`prefix_offset:`) rather than the whole output, and the window
    without the new tokens (`prefix_offset:read_offset`), taking the difference: tokens merge
    across boundaries (leading spaces, multi-byte characters). A window ending in U+FFFD is an
    incomplete UTF-8 sequence: wait for the next token. Both windows of every sequence go to
    the tokenizer in one call.
    """
    if not seqs:
        return []
    windows = []
    for seq in seqs:
        ids = seq.token_ids
        windows.append(ids[seq.prefix_offset : seq.read_offset])
        windows.append(ids[seq.prefix_offset : seq.num_known_tokens])
    texts = decode_batch(windows)
    old_lengths = []
    for index, seq in enumerate(seqs):
        prefix_text, full_text = texts[2 * index], texts[2 * index + 1]
        old_lengths.append(len(seq.output_text))
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            seq.output_text += full_text[len(prefix_text) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = seq.num_known_tokens
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


def cut_at_stop_string(seq: Sequence, num_old_chars: int) -> bool:
    """Cut `seq.output_text` at the earliest stop string that ends in its text past
    `num_old_chars` (once `min_tokens` are out); whether one did."""
    params = seq.sampling
    if not params.stop or seq.num_known_output_tokens < params.min_tokens:
        return False
    cut = find_stop_string(seq.output_text, params.stop, num_old_chars)
    if cut is None:
        return False
    seq.output_text = seq.output_text[:cut]
    return True


def take_new_text(seq: Sequence, is_finished: bool) -> str:
    """The text not yet handed out; all of it once finished, else all but what may still
    become the start of a stop string (which stays back)."""
    if is_finished:
        num_visible = len(seq.output_text)
    else:
        num_held = max((len(s) for s in seq.sampling.stop), default=1) - 1
        num_visible = max(seq.num_text_emitted, len(seq.output_text) - num_held)
    new_text = seq.output_text[seq.num_text_emitted : num_visible]
    seq.num_text_emitted = num_visible
    return new_text
