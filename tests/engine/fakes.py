"""A fake model runner that reads its KV cache back, and helpers to drive `LLMEngine` with it.

`PagedFakeRunner` stores token ids where a model stores keys and values (one slot per token,
addressed through the block tables, swapped through its own CPU pool) and samples a pure
function of the history it reads back. A wrong block id, a stale prefix-cache hit or a lost
swap changes the tokens that follow. `oom_at_steps` injects device out-of-memory errors.
`launch` serves asynchronous scheduling: a placeholder input takes the token the previous
launched step sampled for that request, as the device runner gathers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import msgspec

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.block_pool import NULL_BLOCK_ID
from pagekeeper_engine.core.kv_copies import CopyFence
from pagekeeper_engine.core.limits import SchedulerConfig, resolve_limits
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.protocols import AllocatorMonitorProtocol
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError
from pagekeeper_engine.messages import EngineOutput

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMN"  # token id -> one character
EOS = len(ALPHABET) - 1  # "N"
BS = 4


class CharTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = len(ALPHABET)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        self.num_batch_calls += 1
        return [self.decode(ids) for ids in batch]

    num_batch_calls = 0


class IdTokenizer:
    """Token ids as space-separated numbers, for the real model's random vocabulary."""

    eos_token_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


def next_token(history: list[int]) -> int:
    """The fake model: a pure function of the whole token history; never EOS."""
    return (sum(history) * 7 + len(history)) % EOS


def rollout(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class PagedFakeRunner:
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        script: dict[str, list[int]] | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.num_host_blocks = num_host_blocks
        self.host_block_bytes = 64
        self.kv_load_seconds = 0.0
        self.grammar_timings = GrammarTimings()
        self.gpu: list[list[int | None]] = [[None] * BS for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * BS for _ in range(num_cpu_blocks)]
        # The host tier's blocks, and its copies as a device that runs them as late as it may:
        # each waits until a step's fence covers it (copies of one step: loads, then stores).
        self.host: list[list[int | None]] = [[None] * BS for _ in range(num_host_blocks)]
        self.pending_copies: list[list[tuple[str, int, int]]] = []
        self.num_copies_applied = 0
        self.script = script
        self.fail_next: bool | BaseException = False  # the next execute raises (this)
        self.oom_at_steps: set[int] = set()  # calls of execute (0-based) that run out of memory
        self.num_calls = 0
        self.num_swap_ooms = 0
        self.allocator_monitor: AllocatorMonitorProtocol | None = None
        self.num_batched_tokens: list[int] = []
        self.previous_samples: dict[str, int] = {}  # the last launched step's tokens
        self.num_placeholders = 0
        # called with the call's index before each execute, on the core's thread: a test holds
        # a step here until what it waits for has happened (never a sleep)
        self.before_execute: Callable[[int], None] | None = None

    def launch(self, out: SchedulerOutput) -> DoneStep:
        seqs = []
        for item in out.seqs:
            assert PLACEHOLDER_TOKEN_ID not in item.token_ids[:-1], item
            if item.token_ids[-1:] == [PLACEHOLDER_TOKEN_ID]:
                assert item.num_tokens == 1, f"{item.request_id}: a placeholder in a prefill"
                seqs.append(
                    msgspec.structs.replace(
                        item, token_ids=[self.previous_samples[item.request_id]]
                    )
                )
                self.num_placeholders += 1
            else:
                seqs.append(item)
        result = self.execute(replace(out, seqs=seqs))
        self.previous_samples = {
            s.request_id: t
            for s, t in zip(out.seqs, result.sampled_token_ids, strict=True)
            if t is not None
        }
        return DoneStep(result)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        call = self.num_calls
        self.num_calls += 1
        if self.before_execute is not None:
            self.before_execute(call)
        self._issue_copies(out)  # first, as the runner does: nothing before it can fail
        if self.fail_next:
            failure = self.fail_next
            self.fail_next = False
            raise (
                failure if isinstance(failure, BaseException) else RuntimeError("device fell over")
            )
        if call in self.oom_at_steps:
            raise DeviceOutOfMemoryError("step", f"injected at call {call}")
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in out.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        self.num_batched_tokens.append(out.num_batched_tokens)
        tokens: list[int | None] = []
        for s in out.seqs:
            assert NULL_BLOCK_ID not in s.block_ids
            for offset, token in enumerate(s.token_ids):
                pos = s.start_pos + offset
                self.gpu[s.block_ids[pos // BS]][pos % BS] = token
            if not s.needs_sample:
                tokens.append(None)
                continue
            end = s.start_pos + s.num_tokens
            history = [self.gpu[s.block_ids[p // BS]][p % BS] for p in range(end)]
            assert None not in history, f"{s.request_id} read an unwritten slot"
            if self.script is not None:
                tokens.append(self.script[s.request_id][s.num_output_tokens])
            else:
                tokens.append(next_token([t for t in history if t is not None]))
        logprobs = [None if t is None else -t / 100 for t in tokens]
        return RunnerOutput(tokens, logprobs)

    def _issue_copies(self, out: SchedulerOutput) -> None:
        """Queue the step's host-tier copies in the device's order (early loads, stores, late
        loads); apply, oldest first, those its fence waits for."""
        early = [("load", h, g) for h, g in out.kv_loads]
        rest = [("store", g, h) for g, h in out.kv_stores]
        rest += [("load", h, g) for h, g in out.kv_late_loads]
        if out.kv_fence >= CopyFence.PREVIOUS:
            self._apply_copies()
        self.pending_copies.append(early)
        if out.kv_fence >= CopyFence.LOADS:
            self._apply_copies()
        self.pending_copies.append(rest)
        if out.kv_fence is CopyFence.ALL:
            self._apply_copies()

    def _apply_copies(self) -> None:
        for step in self.pending_copies:
            for kind, src, dst in step:
                if kind == "load":
                    self.gpu[dst] = list(self.host[src])
                else:
                    self.host[dst] = list(self.gpu[src])
                self.num_copies_applied += 1
        self.pending_copies = []


class DoneStep:
    def __init__(self, result: RunnerOutput) -> None:
        self._result = result

    def result(self) -> RunnerOutput:
        return self._result


def make_engine(
    num_gpu_blocks: int = 256,
    num_cpu_blocks: int = 0,
    budget: int = 64,
    chunked: bool = True,
    prefix: bool = True,
    max_model_len: int = 128,
    min_swap_tokens: int = 512,
    script: dict[str, list[int]] | None = None,
    max_consecutive_ooms: int = 8,
    runner: PagedFakeRunner | None = None,
    async_scheduling: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    num_host_blocks: int = 0,
) -> tuple[LLMEngine, PagedFakeRunner]:
    config = EngineConfig(
        model="fake",
        block_size=BS,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        max_consecutive_ooms=max_consecutive_ooms,
        async_scheduling=async_scheduling,
    )
    sched_config = replace(
        SchedulerConfig.from_engine_config(config, resolve_limits(config, max_model_len)),
        min_swap_tokens=min_swap_tokens,
    )
    if runner is None:
        runner = PagedFakeRunner(num_gpu_blocks, num_cpu_blocks, script, num_host_blocks)
    engine = LLMEngine(config, runner, CharTokenizer().eos_token_ids, sched_config, clock=clock)
    return engine, runner


def run_all(engine: LLMEngine) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(5000):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish within 5000 steps")


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]
