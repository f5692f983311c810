"""Continuous batching: which tokens of which sequences run in the next step.

Pure Python; never imports torch. `schedule()` returns a `SchedulerOutput` for the runner;
`update()` applies the runner's sampled tokens. Stop conditions are the engine loop's.

Asynchronous scheduling splits `update` in two: `advance` books a launched step at once (its
computed tokens, and a placeholder for each token it will sample), so the next step can be
scheduled while the device runs this one; `fill` writes the sampled values when they arrive,
one step later. The scheduler needs nothing else: a sequence whose newest token is a
placeholder is an ordinary one-token decode.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagekeeper_engine.core.block_pool import BlockPool
from pagekeeper_engine.core.kv_manager import KVCacheManager, num_blocks_for
from pagekeeper_engine.core.limits import RequestRejectedError, SchedulerConfig, check_prompt
from pagekeeper_engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from pagekeeper_engine.core.preemption import (
    PreemptionMode,
    choose_preemption_mode,
    reset_for_recompute,
    swap_in,
    swap_out,
)
from pagekeeper_engine.core.sequence import Sequence, SequenceStatus

# The errors `add_request` raises and the config `Scheduler` takes are part of its interface.
__all__ = ["RequestRejectedError", "Scheduler", "SchedulerConfig"]


@dataclass
class _Step:
    """The step being built: its remaining token budget, work and block moves."""

    budget: int
    work: list[tuple[Sequence, int]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)

    def take(self, seq: Sequence, num_tokens: int) -> None:
        self.work.append((seq, num_tokens))
        self.ids.add(seq.request_id)
        self.budget -= num_tokens


class Scheduler:
    """Continuous batching with a token budget, chunked prefill, admission and preemption.

    One step, in order: (1) running sequences with one token left (decodes), oldest first; a
    decode that needs a block nobody has preempts the newest running sequence not yet scheduled
    (itself last), by swap or recompute; (2) only if nothing was preempted, swapped sequences
    come back, oldest first; (3) running prefills continue in chunks; (4) only if nothing was
    preempted and nothing is swapped, waiting requests are admitted first-come first-served,
    each only when blocks for its whole prompt fit with `kv_watermark` of the pool left free
    (the blocks are reserved then, so a prefill never stalls half way). Decodes may use the
    watermark; with nothing running it is waived, so a sequence that grew into it can return.
    Every step takes at most `max_num_batched_tokens` tokens; at most `max_num_seqs` run.

    A request admitted with a prefix on the host tier takes its blocks at once and runs in the
    same step, its forward pass behind the loads, which overlap the step in flight; where a
    load must wait for that step, the request runs from the next step on (`core.kv_copies`).
    The step carries the host tier's copies and the fence its forward pass waits at.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        num_host_blocks: int = 0,
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(
            num_gpu_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_cache_max_fraction=config.prefix_cache_max_fraction,
            num_host_blocks=num_host_blocks,
        )
        self.cpu_pool = (
            BlockPool(num_cpu_blocks, reserve_null_block=False) if num_cpu_blocks > 0 else None
        )
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.watermark_blocks = int(config.kv_watermark * self.kv.num_usable_blocks)
        capacity = self.kv.num_usable_blocks * config.block_size
        # a sequence stops ("length") here: the model's limit, or what the whole pool holds
        self.max_seq_len = min(capacity, config.max_model_len or capacity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_swap_preemptions + self.num_recompute_preemptions

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def check_request(self, num_prompt_tokens: int) -> None:
        """Raise RequestRejectedError when a prompt of this length can never run."""
        max_blocks = self.kv.num_usable_blocks - self.watermark_blocks
        check_prompt(self.config, num_prompt_tokens, max_blocks, self.max_num_batched_tokens)

    def add_request(self, seq: Sequence) -> None:
        """Queue a new sequence; RequestRejectedError if it can never fit or its id is in use."""
        if seq.request_id in self.requests:
            raise RequestRejectedError(f"request id {seq.request_id!r} is already in flight")
        self.check_request(seq.num_prompt_tokens)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of every queue and free its blocks."""
        assert status.is_finished, status
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        if seq.status is SequenceStatus.SWAPPED:
            assert self.cpu_pool is not None
            self.cpu_pool.free(seq.block_ids)
            seq.block_ids = []
        else:
            self.kv.free(seq)
        seq.status = status
        self.kv.copies.forget(seq.request_id)
        del self.requests[seq.request_id]

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.max_num_batched_tokens)
        for seq in list(self.running):
            if step.budget == 0:
                break
            if (
                seq.status is not SequenceStatus.RUNNING
                or seq.num_uncomputed_tokens != 1
                or self._is_length_done(seq)
            ):
                continue
            # a one-token prompt remainder may read blocks an earlier step loaded
            self.kv.copies.runs(seq.request_id)
            if self.kv.num_blocks_to_append(seq, 1) == 0:  # its last block has a free slot
                step.take(seq, 1)
                continue
            while not self.kv.can_append(seq, 1):
                victim = next(s for s in reversed(self.running) if s.request_id not in step.ids)
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.kv.append_slots(seq, 1)
                step.take(seq, 1)

        if not step.preempted_ids:
            self._swap_in_ready(step)

        for seq in self.running:
            if step.budget == 0:
                break
            if seq.request_id in step.ids:
                continue
            # prompts in progress: their blocks were reserved at admission
            num_tokens = min(seq.num_uncomputed_tokens, step.budget)
            if self._is_length_done(seq) or not self.kv.can_append(seq, num_tokens):
                continue
            self.kv.append_slots(seq, num_tokens)
            self.kv.copies.runs(seq.request_id)
            step.take(seq, num_tokens)

        if not step.preempted_ids and not self.swapped:
            self._admit(step)

        # query length 1 first: the attention metadata's decode rows lead the batch
        step.work.sort(key=lambda item: item[1] > 1)
        copies = self.kv.copies.take()
        return SchedulerOutput(
            seqs=[self._scheduled_seq(seq, n) for seq, n in step.work],
            num_batched_tokens=self.max_num_batched_tokens - step.budget,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            preempted_ids=step.preempted_ids,
            swapped_in_ids=step.swapped_in_ids,
            kv_loads=copies.loads,
            kv_stores=copies.stores,
            kv_fence=copies.fence,
            kv_late_loads=copies.late_loads,
        )

    def _is_length_done(self, seq: Sequence) -> bool:
        """Whether `seq` ends on the length limit once its pending tokens arrive: nothing to
        compute for it (only an asynchronous step leaves such a sequence running)."""
        return seq.num_pending_tokens > 0 and (
            seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.max_seq_len
        )

    def _swap_in_ready(self, step: _Step) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_needed = num_blocks_for(seq.num_tokens, self.config.block_size)
            if num_needed > self.kv.num_free_blocks - self._reserve_blocks():
                return
            self.swapped.popleft()
            assert self.cpu_pool is not None
            step.swap_in.extend(swap_in(seq, self.kv, self.cpu_pool))
            step.swapped_in_ids.append(seq.request_id)
            self.running.append(seq)
            if step.budget > 0 and seq.num_uncomputed_tokens == 1:
                step.take(seq, 1)

    def _admit(self, step: _Step) -> None:
        cfg = self.config
        while self.waiting and step.budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            num_uncached = seq.num_tokens - cached.num_blocks * cfg.block_size
            # a resumed sequence may recompute in chunks even without chunked prefill
            can_chunk = cfg.enable_chunked_prefill or seq.num_output_tokens > 0
            if not can_chunk and num_uncached > step.budget:
                return
            num_needed = self.kv.num_blocks_to_admit(seq, cached)
            if num_needed > self.kv.num_free_blocks - self._reserve_blocks():
                return
            self.waiting.popleft()
            self.kv.admit(seq, cached)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.kv.copies.is_loading_now(seq.request_id):
                continue  # a late load: it runs once its prefix is back from the host tier
            self.kv.copies.runs(seq.request_id)
            step.take(seq, min(num_uncached, step.budget))

    def _reserve_blocks(self) -> int:
        # the watermark is headroom for running decodes; with none running it would only keep
        # out a sequence that grew into it before being preempted
        return self.watermark_blocks if self.running else 0

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        step.preempted_ids.append(seq.request_id)
        num_to_swap = num_blocks_for(seq.num_computed_tokens, self.config.block_size)
        num_free_cpu = self.cpu_pool.num_free_blocks if self.cpu_pool is not None else 0
        mode = choose_preemption_mode(
            seq.num_computed_tokens, num_free_cpu, num_to_swap, self.config.min_swap_tokens
        )
        if mode is PreemptionMode.RECOMPUTE:
            # victims go newest first, so each lands ahead of the newer ones
            self.preempt_for_recompute(seq)
            return
        assert self.cpu_pool is not None
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.kv.copies.forget(seq.request_id)
        step.swap_out.extend(swap_out(seq, self.kv, self.cpu_pool, num_to_swap))
        self.swapped.append(seq)
        self.num_swap_preemptions += 1

    def preempt_for_recompute(self, seq: Sequence) -> None:
        """Send a running sequence back to the head of the queue with no blocks; it recomputes
        (mostly prefix-cache hits: its full blocks stay cached) when it is admitted again."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.kv.copies.forget(seq.request_id)
        reset_for_recompute(seq, self.kv)
        self.waiting.appendleft(seq)
        self.num_recompute_preemptions += 1

    def _scheduled_seq(self, seq: Sequence, num_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start : start + num_tokens],
            start_pos=start,
            block_ids=list(seq.block_ids),
            needs_sample=start + num_tokens == seq.num_tokens,
            sampling=seq.sampling,
            num_output_tokens=seq.num_output_tokens,
            all_token_ids=seq.token_ids,
            num_prompt_tokens=len(seq.prompt_token_ids),
        )

    def update(self, out: SchedulerOutput, runner_out: RunnerOutput) -> list[Sequence]:
        """Advance computed counts, register full blocks, append sampled tokens.

        Returns the sequences that received a token, in batch order.
        """
        seqs = self.advance(out)
        sampled = self.fill(out, seqs, runner_out)
        for seq in sampled:
            self.cache_known_blocks(seq)
        return sampled

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """Book a launched step: computed counts move on and each sampled row appends a
        placeholder. Registers the full blocks whose tokens are all known. Returns the step's
        sequences in batch order (for `fill`)."""
        seqs = []
        for item in out.seqs:
            seq = self.requests[item.request_id]
            assert seq.status is SequenceStatus.RUNNING, f"{seq.request_id} is {seq.status}"
            seq.num_computed_tokens += item.num_tokens
            if item.needs_sample:
                seq.append_placeholder()
            self.cache_known_blocks(seq)
            seqs.append(seq)
        return seqs

    def fill(
        self, out: SchedulerOutput, seqs: list[Sequence], runner_out: RunnerOutput
    ) -> list[Sequence]:
        """Write a step's sampled tokens over the placeholders `advance` booked.

        Skips sequences that finished meanwhile; a preempted one still gets its token (it was
        sampled from a complete history). Returns the sequences that received a token, in
        batch order; their newly completed blocks are not registered yet (`cache_known_blocks`
        once the caller knows the sequence goes on, `discard_pending` before it finishes).
        """
        assert len(runner_out.sampled_token_ids) == len(out.seqs), "one result per sequence"
        sampled: list[Sequence] = []
        tops = runner_out.top_logprobs
        for i, (item, seq, token_id, logprob) in enumerate(
            zip(out.seqs, seqs, runner_out.sampled_token_ids, runner_out.logprobs, strict=True)
        ):
            if not item.needs_sample or seq.status.is_finished:
                continue
            assert token_id is not None, f"no token sampled for {item.request_id}"
            seq.fill_placeholder(token_id, logprob)
            num_top = seq.sampling.top_logprobs
            if num_top and tops is not None and (top := tops[i]) is not None:
                # the step computed the batch's largest count; this request keeps its own
                seq.top_logprobs[seq.num_known_output_tokens - 1] = top[:num_top]
            sampled.append(seq)
        return sampled

    def cache_known_blocks(self, seq: Sequence) -> None:
        """Register the full computed blocks of a running sequence whose tokens are known."""
        if self.kv.enable_prefix_caching and seq.status is SequenceStatus.RUNNING:
            self.kv.cache_computed_blocks(seq, seq.num_known_tokens)

    def discard_pending(self, seq: Sequence) -> None:
        """Undo the speculative step of a sequence about to finish: its placeholders go, and
        the computed count returns to what the synchronous loop would hold (each pending token
        was booked together with its predecessor's computation)."""
        num_dropped = seq.drop_placeholders()
        if num_dropped and seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= num_dropped
        self.cache_known_blocks(seq)
