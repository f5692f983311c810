"""Prompt text to token ids without stalling the event loop.

A front end's event loop also writes every streamed token of every request in flight. Encoding
a long prompt on it (about a millisecond per thousand words, more for byte-level BPE) stalls
all of those streams, and a burst of arrivals stalls them once per prompt. So long prompts are
encoded on a worker thread in one `encode_batch` call per batch: the tokenizer releases the
GIL there and spreads a batch over its own threads. Prompts that arrive while a batch is being
encoded wait and go together in the next one, so a burst of N arrivals costs a few calls, not
N. Short prompts cost less than the hand-off and are encoded where they arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

# Prompts shorter than this (characters) are encoded inline: tens of microseconds at most,
# about what a round trip through a worker thread costs.
INLINE_MAX_CHARS = 1024


class BatchTokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]: ...


@dataclass
class _Pending:
    text: str
    add_special_tokens: bool
    future: asyncio.Future[list[int]]


class PromptEncoder:
    """Encodes prompts for one front end's handlers; `encode` is safe to cancel."""

    def __init__(self, tokenizer: BatchTokenizer, *, inline_max_chars: int = INLINE_MAX_CHARS):
        self._tokenizer = tokenizer
        self._inline_max_chars = inline_max_chars
        self._pending: list[_Pending] = []
        self._worker: asyncio.Task[None] | None = None
        self.num_batches = 0  # encode_batch calls made off the loop

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(text) < self._inline_max_chars:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(text, add_special_tokens, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="prompt-encoder")
        return await future

    async def _drain(self) -> None:
        """Encode what is pending, batch after batch, until nothing is."""
        while self._pending:
            batch, self._pending = self._pending, []
            for flag in (True, False):
                group = [p for p in batch if p.add_special_tokens is flag and not p.future.done()]
                if group:
                    await self._encode_group(group, flag)

    async def _encode_group(self, group: list[_Pending], add_special_tokens: bool) -> None:
        texts = [p.text for p in group]
        self.num_batches += 1
        try:
            encoded = await asyncio.to_thread(
                self._tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens
            )
        except Exception as exc:  # each waiting handler answers it (a 500 names the error)
            logger.exception("encoding a batch of %d prompts failed", len(group))
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        for p, ids in zip(group, encoded, strict=True):
            if not p.future.done():  # its handler was cancelled (a client that left)
                p.future.set_result(ids)
