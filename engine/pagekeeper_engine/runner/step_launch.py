"""One step's data path on the device, from scheduled sequences to sampled ids on their way to
the host.

The step's sequences are packed into tensors and attention metadata (`step_inputs`), padded to
a captured graph's shape where one fits. A decode whose previous token was sampled by the step
before it finds a placeholder in its input row: the previous step's ids are gathered into those
rows on the device, so a step can be launched before the one before it has come back. The
forward pass runs eagerly or as a graph replay, and logits are computed only for the rows that
are sampled (or taken from the replay that computed them). Under tensor parallelism each rank
holds its vocabulary shard's logits: the common batches are picked across the shards
(`shard_pick`), every rank getting the same ids; any other batch is gathered to rank 0, which
samples it and broadcasts the ids, so every rank's next step reads the same placeholders.
The other ranks run rank 0's packed inputs (`follow`): they never see the scheduler's
sequences, only the sampled rows' parameters and request ids (`follower_step.py`).

A step holding a structured request (on one device) is sampled one launch late: its launch
enqueues the forward pass and the logits, hands its grammar work to the grammar thread
(`structured_output`) and returns a `DeferredStep`; the next launch, before it gathers that
step's ids, enqueues its sampling (the masks are filled by then, while the host settled,
scheduled and packed), as does the step's `result` if that comes first. The device runs the
same work in the same order as for any step; only the host stops waiting for the grammar. A
step without a schema takes the path it always took.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.runner.cuda_graphs import StepGraphs
from pagekeeper_engine.runner.follower_step import FollowerStep
from pagekeeper_engine.runner.logits_processing import StepHistory, uses_grammars
from pagekeeper_engine.runner.sampler import Sampler
from pagekeeper_engine.runner.shard_pick import ShardPicker
from pagekeeper_engine.runner.step_inputs import StepInputBuilder, StepInputs
from pagekeeper_engine.runner.step_results import (
    DeferredStep,
    HostResultBuffers,
    LaunchedStep,
    PendingStep,
)
from pagekeeper_engine.runner.structured_output import PendingMasks


class StepLauncher:
    """Enqueues steps of one model (or rank's shard) on the device; `graphs` are the captured
    ones, None while the runner runs eagerly."""

    def __init__(
        self,
        model: CausalLM,
        inputs: StepInputBuilder,
        sampler: Sampler,  # with its buffers (empty on ranks > 0)
        results: HostResultBuffers,
        tp: TensorParallelGroup,
        shards: ShardPicker | None = None,  # under tensor parallelism
    ):
        assert (shards is not None) == (tp.size > 1), "a shard picker exactly under TP"
        assert sampler.buffers is not None, "a step samples in buffers allocated once"
        self.model = model
        self.inputs = inputs
        self.sampler = sampler
        self.sampler_buffers = sampler.buffers
        # (max rows, V or the rank's shard): where the LM head writes, graphs included.
        self.logits_out = sampler.buffers.logits if shards is None else shards.logits
        self.results = results
        self.tp = tp
        self.shards = shards
        self.graphs: StepGraphs | None = None
        # The newest launched step's sampled ids (N,) int64 on the device, and each sampled
        # request's row in them: the next step's placeholder inputs come from there.
        self._previous_sampled: torch.Tensor | None = None
        self._previous_rows: dict[str, int] = {}
        self._deferred: DeferredStep | None = None  # the step whose sampling is still to come

    @property
    def sampling_nbytes(self) -> int:
        """The sampler's and the shard picker's rows: activations the start-up budget counts."""
        shards = 0 if self.shards is None else self.shards.nbytes
        return self.sampler_buffers.nbytes + shards

    def prepare(self, seqs: Sequence[ScheduledSeq], *, keep_packed: bool = False) -> StepInputs:
        """Pack the step's sequences (decodes first) into tensors and attention metadata on the
        device, padded to a captured graph's shape where one fits (`keep_packed`: with their
        bytes, for the other ranks)."""
        padding = None if self.graphs is None else self.graphs.padding_for(seqs)
        return self.inputs.build(seqs, padding, self._previous_rows, keep_packed=keep_packed)

    @torch.inference_mode()
    def run(self, step: StepInputs, seqs: Sequence[ScheduledSeq]) -> LaunchedStep:
        """Run a step that `prepare` made of `seqs`, without waiting."""
        picked = [seqs[i] for i in step.sampled_seqs]
        return self._run(
            step,
            len(seqs),
            [s.request_id for s in picked],
            [s.sampling for s in picked],
            [s.num_output_tokens for s in picked],
            StepHistory(picked, step.input_ids, step.sample_indices),
        )

    @torch.inference_mode()
    def follow(self, step: FollowerStep) -> LaunchedStep:
        """Run the step rank 0 packed (a rank > 0 under tensor parallelism), without waiting."""
        if step.inputs is None:
            return PendingStep(0, [], None, None)
        return self._run(
            self.inputs.unpack(step.inputs),
            step.num_seqs,
            step.request_ids,
            step.sampling,
            step.num_output_tokens,
        )

    def _run(
        self,
        step: StepInputs,
        num_seqs: int,
        request_ids: Sequence[str],  # the sampled rows'
        sampling: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        history: StepHistory | None = None,  # rank 0's: the sampled rows' tokens so far
    ) -> LaunchedStep:
        if self._deferred is not None:  # the step before's ids, before they are gathered
            self._deferred.sampled()
        if step.placeholder_rows is not None:
            sources = step.placeholder_sources
            assert self._previous_sampled is not None and sources is not None
            # the tokens the previous step sampled, into this step's input rows (in place: a
            # graph reads input_ids at its captured address); a step's decodes lead, so their
            # rows take the gather directly, in one launch
            if step.placeholders_lead:
                leading = step.input_ids[: sources.shape[0]]
                torch.index_select(self._previous_sampled, 0, sources, out=leading)
            else:
                step.input_ids[step.placeholder_rows] = self._previous_sampled[sources]
        if history is not None and uses_grammars(sampling):
            # the schemas' masks read the newest ids on the host: start their copy before the
            # forward, so reading them waits for the step before and not for this forward
            history = history.with_newest_on_host()
        hidden = (  # (T, H)
            self.model(step.input_ids, step.positions, step.meta)
            if self.graphs is None
            else self.graphs.forward(step)
        )
        if not step.sampled_seqs:
            return PendingStep(num_seqs, [], None, None)
        logits = self._logits(step, hidden)  # (N, V or the rank's shard), the model's dtype
        masks = None
        if history is not None and uses_grammars(sampling):
            assert self.sampler.grammar is not None, "structured rows on a rank without grammars"
            masks = self.sampler.grammar.start(sampling, history)
            if self.shards is None:
                self._previous_rows = {
                    request_id: row for row, request_id in enumerate(request_ids)
                }
                deferred = (step, num_seqs, request_ids, sampling, num_output_tokens, history)
                self._deferred = DeferredStep(
                    lambda: self._sample_deferred(*deferred, masks, logits)
                )
                return self._deferred
        return self._sample(
            step, num_seqs, request_ids, sampling, num_output_tokens, history, masks, logits
        )

    def _sample(
        self,
        step: StepInputs,
        num_seqs: int,
        request_ids: Sequence[str],
        sampling: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        history: StepHistory | None,
        masks: PendingMasks | None,
        logits: torch.Tensor,  # (N, V or the rank's shard)
    ) -> PendingStep:
        token_ids, packed = self.sample_rows(logits, sampling, num_output_tokens, history, masks)
        self._remember(token_ids, request_ids)
        if packed is None:  # rank > 0: rank 0 hands the results over
            return PendingStep(num_seqs, [], None, None)
        pending = self.results.send(num_seqs, step.sampled_seqs, packed)
        if masks is not None:
            pending.cut_rows = masks.filled.result()
        return pending

    def _sample_deferred(
        self,
        step: StepInputs,
        num_seqs: int,
        request_ids: Sequence[str],
        sampling: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        history: StepHistory,
        masks: PendingMasks,
        logits: torch.Tensor,  # in the LM head's buffer: no forward pass was enqueued since
    ) -> PendingStep:
        self._deferred = None
        return self._sample(
            step, num_seqs, request_ids, sampling, num_output_tokens, history, masks, logits
        )

    def sample_rows(
        self,
        logits: torch.Tensor,  # (N, V or the rank's shard): compute_logits' rows
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        history: StepHistory | None = None,
        masks: PendingMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's ids (N,) int64 and, on rank 0, the (2 + 2K, N) float64 [ids;
        log-probs; top alternatives] for the host (None on the other ranks), left on the
        device. A batch with logits processors is always sampled whole on rank 0."""
        if self.shards is None:
            return self.sampler.sample(logits, params, num_output_tokens, history, masks)
        picked = self.shards.pick(logits, params, num_output_tokens)
        if picked is not None:
            token_ids, packed = picked
            return token_ids, packed if self.tp.is_first else None
        # rank 0 samples the whole logits in the sampler's rows
        whole = self.model.gather_logits(
            logits, self.shards.gathered_logits, self.sampler_buffers.logits
        )
        if whole is None:  # rank > 0: rank 0 samples, and its ids come back here
            token_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
            self.tp.broadcast_(token_ids)
            return token_ids, None
        token_ids, packed = self.sampler.sample(whole, params, num_output_tokens, history, masks)
        self.tp.broadcast_(token_ids)
        return token_ids, packed

    def _remember(self, token_ids: torch.Tensor, request_ids: Sequence[str]) -> None:
        self._previous_sampled = token_ids
        self._previous_rows = {request_id: row for row, request_id in enumerate(request_ids)}

    def _logits(self, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits: those the step's decode graph computed where it did."""
        num_sampled = len(step.sampled_seqs)
        if step.samples_leading_rows:
            replayed = None if self.graphs is None else self.graphs.replayed_logits(step)
            if replayed is not None:
                return replayed[:num_sampled]
            rows = hidden[:num_sampled]
        else:
            rows = hidden[step.sample_indices]
        return self.model.compute_logits(rows, self.logits_out)
