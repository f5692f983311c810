"""Structured output: every token of a `json_schema` request is one its schema allows.

Each such request gets a grammar matcher of xgrammar (a library made for this: it compiles a
JSON schema against the tokenizer's vocabulary once, and then gives, at each step, the set of
tokens that keep the output a prefix of a match as a bitmask over the vocabulary). Once the
schema is complete only the end-of-sequence tokens stay allowed, so the request ends there.

A step's masks are made in two halves, so the host's grammar work never sits between the
device's steps:
- `start`, at the launch, right after the forward pass is enqueued: it fixes what the grammar
  work needs (`grammar_fill.FillJob`) and hands it to the grammar thread. There each matcher
  takes its newest token, read from the host copy the launch started before the forward pass
  (so the wait is for the step before, which sampled it), and xgrammar's batch matcher fills
  the rows of a pinned host bitmask on threads of its own (they release the GIL): one, or up
  to `MAX_FILL_THREADS` where the rows' work asks for more (`fill_threads`). Meanwhile the
  step loop's thread settles the step before, schedules the next step and packs its inputs,
  and the device runs this step's forward pass.
- `apply`, when the step is sampled (`step_launch` defers a structured step's sampling to the
  next launch, or to the step's result): it takes the filled mask, copies it to the device in
  one non-blocking copy and sets the disallowed scores to -inf in one launch, before any other
  processor (`logits_processing.process_scores`). Nothing waits for the device.

Each structured step's grammar work is timed into histograms (`grammar_timing`: the grammar
thread's job and its parts, the step loop's wait for it in `apply`, the apply itself), which the
runner reports with the loop's stats (`timings`).

Two host bitmasks are used in turn; each records an event once its copy to the device is
enqueued, and the grammar thread waits for that event before it fills the buffer again. A
schema the vocabulary cannot continue mid-way (no token allowed) holds its row to the
end-of-sequence tokens and reports the row as cut, so the reply ends with `finish_reason`
"length", never as a complete match.

Compact JSON is asked for (no whitespace beyond the separators'), so a model cannot spend its
tokens on blank space. xgrammar (which imports torch and transformers) is imported on the first
structured request; a compiled schema is cached by its text. A request whose schema does not
compile, or whose first token no token of this vocabulary can spell (a word-level vocabulary
without `{`), is refused before it runs (`check`), naming `response_format`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.runner.fill_threads import FillThreads
from pagekeeper_engine.runner.grammar_fill import FillJob, MatcherState, fill_step_masks
from pagekeeper_engine.runner.grammar_timing import FillTimes, GrammarTimer

TOKENIZER_FILE = "tokenizer.json"
# The rows of one step's masks are filled on up to this many threads, as many as their work
# asks for (`fill_threads`).
MAX_FILL_THREADS = 8
# The interpreter's switch interval once the grammar thread runs. That thread gives up the GIL
# in each call into xgrammar or torch, and the step loop's thread, busy in Python, keeps it
# until the interval ends: at the default 5 ms, a step's few calls could wait longer than the
# device's step. Beside a thread busy in Python a step's job waited for it five to ten times,
# and at 0.5 ms it took 2.4 ms in the engine on an H100's host where its work alone takes 1 ms
# (docs/engine.md, structured output).
GRAMMAR_SWITCH_INTERVAL_S = 0.0001


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., V) bool from packed rows of (..., ceil(V / 32)) int32 words: token t is bit t % 32
    of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[..., None] >> shifts) & 1  # (..., W, 32)
    return bits.flatten(-2)[..., :vocab_size].bool()


class SeqTokens(Protocol):
    """A sampled row's sequence: its prompt then outputs, the newest possibly pending."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class StepRows(Protocol):
    """A step's sampled rows as the grammars read them (`logits_processing.StepHistory`)."""

    @property
    def seqs(self) -> Sequence[SeqTokens]: ...

    def newest_token_list(self) -> list[int]: ...


@dataclass(frozen=True)
class PendingMasks:
    """A step's masks on their way: filled on the grammar thread into `host`."""

    host: torch.Tensor  # (N, W) int32 rows of one of the two host bitmasks
    turn: int  # which of the two
    filled: Future[list[int]]  # the rows cut mid-way, once filled
    times: FillTimes  # the fill's moments, set before `filled` is


class GrammarMasks:
    """The schemas' token masks for the sampled rows of rank 0's steps."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,  # the logits' width
        eos_token_ids: frozenset[int],
        max_rows: int,
        device: torch.device,
        fill_threads: int | None = None,  # xgrammar's threads for every step (a benchmark's)
    ) -> None:
        assert fill_threads is None or fill_threads >= 1, f"{fill_threads} fill threads"
        self.model_dir = model_dir
        self.fill_threads = fill_threads
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_rows = max_rows
        self.device = device
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use
        self._compiled: dict[str, Any] = {}  # schema text -> xgrammar.CompiledGrammar
        self._can_start_by_schema: dict[str, bool] = {}  # schema text -> `_can_start`
        self._lock = threading.Lock()
        # a request's matcher, by the id of its parameters (dropped with them)
        self._matchers: dict[int, MatcherState] = {}
        self._host_masks: list[torch.Tensor] = []  # two (max_rows, ceil(V / 32)) int32
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each one's copy enqueued
        self._device_mask: torch.Tensor | None = None
        self._num_started = 0
        # xgrammar.BatchGrammarMatcher by its thread count, each made on first use
        self._batches: dict[int, Any] = {}
        self._threads: FillThreads | None = None  # made with the grammar thread
        self._thread: ThreadPoolExecutor | None = None  # the grammar thread
        self._timer = GrammarTimer()  # observed on the step loop's thread only (`apply`)

    def compile(self, schema: str) -> Any:
        """The xgrammar.CompiledGrammar of a JSON schema's text, compiled once per text."""
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
            compiled = self.compile(params.json_schema)
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

    def _matcher_for(self, params: SamplingParams) -> MatcherState:
        key = id(params)
        state = self._matchers.get(key)
        if state is None:
            import xgrammar  # noqa: PLC0415

            assert params.json_schema is not None
            state = MatcherState(xgrammar.GrammarMatcher(self.compile(params.json_schema)))
            self._matchers[key] = state
            weakref.finalize(params, self._matchers.pop, key, None)
        return state

    def _set_up(self) -> None:
        import xgrammar  # noqa: PLC0415

        is_cuda = self.device.type == "cuda"
        # plain tensors even when the first launch is under inference mode: the grammar thread,
        # outside it, writes them
        with torch.inference_mode(False):
            for _ in range(2):
                host = xgrammar.allocate_token_bitmask(self.max_rows, self.vocab_size)
                self._host_masks.append(host.pin_memory() if is_cuda else host)
            self._device_mask = self._host_masks[0].to(self.device) if is_cuda else None
        self._threads = FillThreads(max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1)))
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        sys.setswitchinterval(min(sys.getswitchinterval(), GRAMMAR_SWITCH_INTERVAL_S))

    def start(self, params: Sequence[SamplingParams], history: StepRows) -> PendingMasks:
        """Hand the step's grammar work to the grammar thread (call once the step's newest ids
        are on their way to the host, `StepHistory.with_newest_on_host`)."""
        if self._thread is None:
            self._set_up()
        assert self._thread is not None
        num_rows = len(params)
        assert num_rows <= self.max_rows, f"{num_rows} rows, masks for {self.max_rows}"
        rows = [row for row, p in enumerate(params) if p.json_schema is not None]
        seqs = [history.seqs[row] for row in rows]
        turn = self._num_started % 2
        self._num_started += 1
        job = FillJob(
            host=self._host_masks[turn][:num_rows],
            rows=rows,
            states=[self._matcher_for(params[row]) for row in rows],
            token_lists=[s.all_token_ids for s in seqs],
            num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
            num_output_tokens=[len(s.all_token_ids) - s.num_prompt_tokens for s in seqs],
            newest_token_ids=history.newest_token_list,
        )
        times = FillTimes(submitted=time.perf_counter())
        filled = self._thread.submit(self._fill, job, self._copied[turn], times)
        return PendingMasks(job.host, turn, filled, times)

    def _fill(self, job: FillJob, copied: torch.cuda.Event | None, times: FillTimes) -> list[int]:
        times.started = time.perf_counter()
        if copied is not None:  # the buffer's last copy to the device has been read
            copied.synchronize()
        assert self._threads is not None
        threads = self.fill_threads or self._threads.choose(len(job.rows))
        cut_rows = fill_step_masks(job, self._batch_on(threads), self.eos_token_ids, times)
        times.ended = time.perf_counter()
        self._threads.observe(threads, times.bitmask_rows, times.bitmask_seconds)
        return cut_rows

    def _batch_on(self, threads: int) -> Any:
        """The batch matcher that fills on `threads` threads (on the grammar thread only)."""
        batch = self._batches.get(threads)
        if batch is None:
            import xgrammar  # noqa: PLC0415

            batch = self._batches[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return batch

    @property
    def fill_row_seconds(self) -> float | None:
        """A row's batch fill on one thread, as the thread count's estimate holds it (None
        before the first structured step)."""
        return None if self._threads is None else self._threads.row_seconds

    def apply(self, scores: torch.Tensor, pending: PendingMasks) -> list[int]:
        """-inf on every token a structured row's schema does not allow next (scores (N, V)
        fp32, rewritten in place); the rows cut mid-way."""
        import xgrammar  # noqa: PLC0415

        started = time.perf_counter()
        mask, filled = self._on_device(pending)
        xgrammar.apply_token_bitmask_inplace(scores, mask, vocab_size=scores.shape[1])
        self._timer.observe(pending.times, filled - started, time.perf_counter() - filled)
        return pending.filled.result()

    def bitmask(self, pending: PendingMasks) -> torch.Tensor:
        """The step's filled masks (N, ceil(V / 32)) int32 where the logits are, for a pick
        that reads them as it picks (`kernels/sampling.py`): the copy to the device is enqueued
        here, once the grammar thread is done."""
        started = time.perf_counter()
        mask, filled = self._on_device(pending)
        self._timer.observe(pending.times, filled - started, time.perf_counter() - filled)
        return mask

    def _on_device(self, pending: PendingMasks) -> tuple[torch.Tensor, float]:
        """Wait for the step's masks, then enqueue their copy to the device: the masks where
        the logits are, and when the wait ended."""
        pending.filled.result()
        filled = time.perf_counter()
        mask = pending.host
        if self._device_mask is not None:
            device = self._device_mask[: mask.shape[0]]
            device.copy_(mask, non_blocking=True)
            event = self._copied[pending.turn] or torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._copied[pending.turn] = event
            mask = device
        return mask, filled

    def timings(self) -> GrammarTimings:
        """The structured steps' histograms so far (read on the step loop's thread)."""
        return self._timer.snapshot()

    def mask_now(
        self, scores: torch.Tensor, params: Sequence[SamplingParams], history: StepRows
    ) -> list[int]:
        """`start` then `apply`: a step sampled as soon as it is launched."""
        return self.apply(scores, self.start(params, history))
