"""Structured output: every token of a `json_schema` request is one its schema allows.

Each such request gets a grammar matcher of xgrammar (a library made for this: it compiles a
JSON schema against the tokenizer's vocabulary once, and then gives, at each step, the set of
tokens that keep the output a prefix of a match as a bitmask over the vocabulary). A step's
matchers fill their rows of a host bitmask allocated once for `max_rows` rows; one copy takes
it to the device, where it sets the disallowed scores to -inf before any other processor
(`logits_processing.process_scores`). Once the schema is complete only the end-of-sequence
tokens stay allowed, so the request ends there.

The step's rows are filled in one call of xgrammar's batch matcher, on up to
`MAX_FILL_THREADS` threads of its own that release the GIL: a row's mask walks the vocabulary,
and filled one row after another the step would wait for every row in turn.

A matcher must have taken every token before it masks the next. Under asynchronous scheduling
a request's newest token is still on the device when its next step launches. The step copies
the newest ids to the host before it enqueues its forward pass (`StepHistory.with_newest_on_host`),
so the masks wait for the step before, which sampled them, while this step's forward runs on the
device; read after the forward was enqueued, they would wait for that forward too, and the host
would fill the masks and schedule the next step with the device idle.
Compact JSON is asked for (no whitespace beyond the separators'), so a model cannot spend its
tokens on blank space.

xgrammar (which imports torch and transformers) is imported on the first structured request;
a compiled schema is cached by its text. A request whose schema does not compile, or whose
first token no token of this vocabulary can spell (a word-level vocabulary without `{`), is
refused before it runs (`check`), naming `response_format`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling import SamplingParams

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
MAX_FILL_THREADS = 8  # the rows of one step's masks are filled on up to this many threads


@dataclass
class _Matcher:
    """A request's matcher and how many of its output tokens it has taken; `is_stuck` once
    its schema can go no further with this vocabulary (the request is then ended: only the
    end-of-sequence tokens stay allowed)."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    is_stuck: bool = False


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) bool from a packed row of (ceil(V / 32),) int32 words: token t is bit t % 32 of
    word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, None] >> shifts) & 1  # (W, 32)
    return bits.flatten()[:vocab_size].bool()


class GrammarMasks:
    """The schemas' token masks for the sampled rows of rank 0's steps."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,  # the logits' width
        eos_token_ids: frozenset[int],
        max_rows: int,
        device: torch.device,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_rows = max_rows
        self.device = device
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use
        self._compiled: dict[str, Any] = {}  # schema text -> xgrammar.CompiledGrammar
        self._can_start_by_schema: dict[str, bool] = {}  # schema text -> `_can_start`
        self._lock = threading.Lock()
        # a request's matcher, by the id of its parameters (dropped with them)
        self._matchers: dict[int, _Matcher] = {}
        self._host_mask: torch.Tensor | None = None  # (max_rows, ceil(V / 32)) int32
        self._device_mask: torch.Tensor | None = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use

    def _compile(self, schema: str) -> Any:
        with self._lock:
            compiled = self._compiled.get(schema)
            if compiled is not None:
                return compiled
            if self._compiler is None:
                self._compiler = self._make_compiler()
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
            self._compiled[schema] = compiled
            return compiled

    def _make_compiler(self) -> Any:
        import xgrammar  # noqa: PLC0415  (imported by the first structured request)
        from tokenizers import Tokenizer  # noqa: PLC0415
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

        tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=Tokenizer.from_file(str(self.model_dir / TOKENIZER_FILE))
        )
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.eos_token_ids)
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def check(self, params: SamplingParams) -> None:
        """RequestRejectedError naming response_format for a schema that does not compile, or
        whose first token this vocabulary cannot spell (its reply could only be empty)."""
        if params.json_schema is None:
            return
        try:
            compiled = self._compile(params.json_schema)
        except RuntimeError as exc:  # xgrammar's converter reports every fault so
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            raise RequestRejectedError(
                f"response_format: the JSON schema cannot be enforced: {reason}",
                param="response_format",
            ) from None
        if not self._can_start(params.json_schema, compiled):
            raise RequestRejectedError(
                "response_format: the model's vocabulary has no token that can begin a reply "
                "matching this schema",
                param="response_format",
            )

    def _can_start(self, schema: str, compiled: Any) -> bool:
        """Whether some token other than end-of-sequence is allowed first (cached by schema)."""
        with self._lock:
            known = self._can_start_by_schema.get(schema)
        if known is not None:
            return known
        import xgrammar  # noqa: PLC0415

        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32)) int32
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        allowed = unpack_bitmask(mask[0], self.vocab_size)  # (V,) bool
        allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = False
        can_start = bool(allowed.any())
        with self._lock:
            self._can_start_by_schema[schema] = can_start
        return can_start

    def _matcher_for(self, params: SamplingParams) -> _Matcher:
        key = id(params)
        state = self._matchers.get(key)
        if state is None:
            import xgrammar  # noqa: PLC0415

            assert params.json_schema is not None
            state = _Matcher(xgrammar.GrammarMatcher(self._compile(params.json_schema)))
            self._matchers[key] = state
            weakref.finalize(params, self._matchers.pop, key, None)
        return state

    def _masks(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host_mask is None:
            import xgrammar  # noqa: PLC0415

            host = xgrammar.allocate_token_bitmask(self.max_rows, self.vocab_size)
            is_cuda = self.device.type == "cuda"
            self._host_mask = host.pin_memory() if is_cuda else host
            self._device_mask = host.to(self.device) if is_cuda else self._host_mask
        assert self._device_mask is not None
        return self._host_mask[:num_rows], self._device_mask[:num_rows]

    @staticmethod
    def _allow_only(mask_row: torch.Tensor, token_ids: frozenset[int]) -> None:
        """A mask row (int32 words, token t at bit t % 32 of word t // 32) allowing only
        `token_ids`."""
        mask_row.zero_()
        for token_id in token_ids:
            word = token_id // 32
            bits = (int(mask_row[word]) & 0xFFFFFFFF) | (1 << (token_id % 32))
            mask_row[word] = bits - (1 << 32) if bits >= 1 << 31 else bits

    def apply(
        self,
        scores: torch.Tensor,  # (N, V) fp32, rewritten in place
        params: Sequence[SamplingParams],
        all_token_ids: Sequence[list[int]],  # each row's prompt then outputs
        num_prompt_tokens: Sequence[int],
        newest_token_ids: Sequence[int],  # (N,) each row's newest token
    ) -> None:
        """-inf on every token a structured row's schema does not allow next."""
        import xgrammar  # noqa: PLC0415

        num_rows = scores.shape[0]
        rows = [row for row, p in enumerate(params) if p.json_schema is not None]
        host, device = self._masks(num_rows)
        host.fill_(-1)  # every token allowed in the other rows
        live: list[tuple[int, _Matcher]] = []
        for row in rows:
            state = self._matcher_for(params[row])
            outputs = all_token_ids[row][num_prompt_tokens[row] :]
            for index in range(state.num_accepted, len(outputs)):
                token_id = newest_token_ids[row] if index == len(outputs) - 1 else outputs[index]
                if not state.is_stuck and not state.matcher.accept_token(token_id):
                    logger.error("token %d does not continue its schema; ending it", token_id)
                    state.is_stuck = True
            state.num_accepted = len(outputs)
            if state.matcher.is_terminated():  # it took an end token the engine did not stop on
                state.is_stuck = True
            if state.is_stuck:
                self._allow_only(host[row], self.eos_token_ids)
            else:
                live.append((row, state))
        if live:
            if self._batch is None:
                threads = max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1))
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
            live_rows = [row for row, _ in live]
            self._batch.batch_fill_next_token_bitmask(
                [state.matcher for _, state in live], host, live_rows
            )
            # a schema this vocabulary cannot continue (no allowed token) ends the reply
            allows_any = host[live_rows].any(dim=1).tolist()
            for (row, state), any_allowed in zip(live, allows_any, strict=True):
                if not any_allowed:
                    state.is_stuck = True
                    self._allow_only(host[row], self.eos_token_ids)
        if device is not host:
            device.copy_(host, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(scores, device, vocab_size=scores.shape[1])
