"""The logits processors and top-k alternatives, over the sampler's preallocated rows.

A batch in which some row asks for a schema, `logit_bias`, a penalty, `min_p` or `top_logprobs`
has its scores (the fp32 copy of its logits in `SamplerBuffers.scores`) rewritten before the
pick, in vLLM's order: the schema's mask (`structured_output`) sets what it disallows to -inf;
the bias is added; the repetition penalty divides a positive score (multiplies a negative one)
of every token in the prompt or the output; the presence penalty is subtracted once and the
frequency penalty once per occurrence from each token of the output; and, for random rows, min-p
drops every token whose probability under softmax(score / T) is below `min_p` times the
likeliest one's, i.e. whose score is below max + T log(min_p). Top-k and top-p then cut what is
left (`top_k_top_p`). The sampled token's logprob and the top-k alternatives are always read
from the model's unmodified logits.

The penalties need each row's tokens so far. They come from the sequence's own token list
(`TokenHistory`), which is whole on the host except, under asynchronous scheduling, its newest
token: that one is this step's input at the row's sampled position, gathered on the device from
the previous step's ids before the forward pass, so it is read from there
(`StepHistory.last_token_ids`). The per-row occurrence counts are built afresh each step by a
scatter into the sampler's draw plane, and the repetition marks into its spare row plane: both
planes exist already (docs/decisions.md, "The penalties count tokens in the sampler's planes").
Nothing here allocates a (batch, vocabulary) tensor; the index tensors scale with the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.runner.structured_output import GrammarMasks, PendingMasks
from pagekeeper_engine.runner.top_k_top_p import CutScratch


class TokenHistory(Protocol):
    """A sampled row's sequence: the prompt then every output token, the newest possibly a
    placeholder (its value is on the device)."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class NewestOnHost:
    """The sampled rows' newest token ids, copied to the host from the step's inputs as soon
    as those hold them: enqueued before the forward pass, so reading them (`tolist`) waits for
    the step before, which wrote them, and not for this step's forward. A CPU tensor is read
    as it is."""

    def __init__(self, ids: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._ids = ids
        if ids.is_cuda:
            self._ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._ids.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return [int(i) for i in self._ids.tolist()]


@dataclass(frozen=True)
class StepHistory:
    """The sampled rows' sequences, in row order, and where their newest tokens are on the
    device: `input_ids[sample_indices]`, or their own copy `newest_ids` once
    `with_newest_on_host` made it (and started its copy to the host): the step's input buffers
    are refilled by the next launch, which a deferred sampling comes after."""

    seqs: Sequence[TokenHistory]
    input_ids: torch.Tensor  # (T,) int64: the step's inputs, placeholders filled
    sample_indices: torch.Tensor  # (N,) int64: each sampled row's last input row
    newest_on_host: NewestOnHost | None = None
    newest_ids: torch.Tensor | None = None  # (N,) int64: a copy of input_ids[sample_indices]

    def last_token_ids(self) -> torch.Tensor:
        if self.newest_ids is not None:
            return self.newest_ids
        return self.input_ids.index_select(0, self.sample_indices)  # (N,)

    def with_newest_on_host(self) -> StepHistory:
        """This history with its newest ids copied on the device and their copy to the host
        enqueued now (call it once the step's inputs hold them, before the forward pass)."""
        newest = self.last_token_ids()
        return replace(self, newest_on_host=NewestOnHost(newest), newest_ids=newest)

    def newest_token_list(self) -> list[int]:
        """The newest ids on the host: from the copy enqueued early, or read now (which waits
        for everything the stream has been given)."""
        if self.newest_on_host is not None:
            return self.newest_on_host.tolist()
        return [int(i) for i in self.last_token_ids().tolist()]


def uses_processors(params: Sequence[SamplingParams]) -> bool:
    return any(p.uses_processors for p in params)


def uses_grammars(params: Sequence[SamplingParams]) -> bool:
    """Whether a row's tokens must be ones its schema allows (the grammars read the rows'
    newest ids on the host)."""
    return any(p.json_schema is not None for p in params)


def masks_alone(params: Sequence[SamplingParams]) -> bool:
    """Whether the schemas' masks are all the batch's processing: some row has a schema and no
    row asks for anything else (`SamplingParams.uses_processors_beside_schema`)."""
    return uses_grammars(params) and not any(p.uses_processors_beside_schema for p in params)


def _on(device: torch.device, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def add_logit_bias(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """scores[row, token] += bias for every (token, bias) of each row's `logit_bias`. Ids the
    logits lack (a tokenizer larger than the model's head) are dropped: they are never
    sampled."""
    vocab_size = scores.shape[1]
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
    if rows:
        device = scores.device
        index = (_on(device, rows, torch.int64), _on(device, token_ids, torch.int64))
        scores.index_put_(index, _on(device, biases, torch.float32), accumulate=True)


def _row_tokens(
    rows: list[int], tokens: list[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) index pairs on the device for `rows[i]`'s `tokens[i]`, in one copy."""
    if not tokens or not sum(len(t) for t in tokens):
        return None
    pairs = np.stack(
        (np.repeat(np.asarray(rows, np.int64), [len(t) for t in tokens]), np.concatenate(tokens))
    )  # (2, M)
    on_device = torch.from_numpy(pairs).to(device, non_blocking=True)
    return on_device[0], on_device[1]


def apply_penalties(
    scores: torch.Tensor,  # (N, V) fp32, rewritten in place
    params: Sequence[SamplingParams],
    history: StepHistory,
    counts: torch.Tensor,  # (>= N, V) fp32 plane, overwritten
    work: torch.Tensor,  # (>= N, V) fp32 plane, overwritten
) -> None:
    num_rows = scores.shape[0]
    device = scores.device
    counts, work = counts[:num_rows], work[:num_rows]
    penalized = [row for row, p in enumerate(params) if p.has_penalties]
    last_ids = history.last_token_ids()  # (N,) on the device
    marked: list[np.ndarray] = []  # the repetition penalty's rows: prompt and outputs
    outputs: list[np.ndarray] = []  # every penalized row's outputs before the newest token
    last_is_output: list[int] = []  # rows whose newest token is an output
    for row in penalized:
        seq = history.seqs[row]
        tokens = seq.all_token_ids
        known = np.array(tokens[:-1], dtype=np.int64)  # the newest is read on the device
        assert not (known == PLACEHOLDER_TOKEN_ID).any(), "only the newest token may be pending"
        if params[row].repetition_penalty != 1.0:
            marked.append(known)
        outputs.append(known[seq.num_prompt_tokens :])
        if len(tokens) > seq.num_prompt_tokens:
            last_is_output.append(row)
    repeated = [row for row in penalized if params[row].repetition_penalty != 1.0]
    if repeated:
        mark_index = _row_tokens(repeated, marked, device)
        log_penalty = [math.log(p.repetition_penalty) for p in params]
        work.zero_()
        if mark_index is not None:
            work[mark_index] = 1.0
        work[torch.arange(num_rows, device=device), last_ids] = 1.0  # the newest token
        work.mul_(_on(device, log_penalty, torch.float32)[:, None])  # m log p, 0 unmarked
        # s * p ** (-m sign(s)): a positive score divided by p, a negative one multiplied
        torch.sign(scores, out=counts)
        counts.mul_(work).neg_().exp_()
        scores.mul_(counts)
    if any(params[row].presence_penalty or params[row].frequency_penalty for row in penalized):
        count_index = _row_tokens(penalized, outputs, device)
        counts.zero_()
        one = torch.ones(1, device=device)
        if count_index is not None:
            counts.index_put_(count_index, one.expand(count_index[0].shape[0]), accumulate=True)
        if last_is_output:
            rows = _on(device, last_is_output, torch.int64)
            counts.index_put_(
                (rows, last_ids.index_select(0, rows)),
                one.expand(len(last_is_output)),
                accumulate=True,
            )
        presence = _on(device, [p.presence_penalty for p in params], torch.float32)
        frequency = _on(device, [p.frequency_penalty for p in params], torch.float32)
        torch.sign(counts, out=work)
        scores.sub_(work.mul_(presence[:, None]))
        torch.mul(counts, frequency[:, None], out=work)
        scores.sub_(work)


def apply_min_p(
    scores: torch.Tensor,  # (N, V) fp32, rewritten in place
    params: Sequence[SamplingParams],
    scratch: CutScratch,
) -> None:
    """-inf below max + T log(min_p) in each random row with min_p > 0; the mask is made a
    chunk of rows at a time in the cut's scratch."""
    offsets = [
        p.temperature * math.log(p.min_p) if p.min_p > 0.0 and not p.is_greedy else -math.inf
        for p in params
    ]
    threshold = scores.amax(dim=-1)  # (N,)
    threshold.add_(_on(scores.device, offsets, torch.float32))
    for start in range(0, scores.shape[0], scratch.num_rows):
        end = min(start + scratch.num_rows, scores.shape[0])
        mask = scratch.mask[: end - start]
        torch.lt(scores[start:end], threshold[start:end, None], out=mask)
        scores[start:end].masked_fill_(mask, float("-inf"))


def process_scores(
    scores: torch.Tensor,  # (N, V) fp32: the (masked) logits' copy, rewritten in place
    params: Sequence[SamplingParams],
    history: StepHistory | None,
    counts: torch.Tensor,  # (>= N, V) fp32 plane
    work: torch.Tensor,  # (>= N, V) fp32 plane
    scratch: CutScratch,
    grammar: GrammarMasks | None = None,
    masks: PendingMasks | None = None,  # the step's masks, started at its launch
) -> None:
    """Every processor the batch's rows ask for, in order (the module docstring)."""
    if uses_grammars(params):
        assert grammar is not None, "a structured request reached a sampler without grammars"
        if masks is None:
            assert history is not None, "the grammars read the rows' tokens so far"
            masks = grammar.start(params, history)
        grammar.apply(scores, masks)
    if any(p.logit_bias for p in params):
        add_logit_bias(scores, params)
    if any(p.has_penalties for p in params):
        assert history is not None, "the penalties read the rows' tokens so far"
        apply_penalties(scores, params, history, counts, work)
    if any(p.min_p > 0.0 and not p.is_greedy for p in params):
        apply_min_p(scores, params, scratch)


def top_logprobs(
    logits: torch.Tensor,  # (N, V) the model's unmodified logits
    num_top: int,
    work: torch.Tensor,  # (>= N, V) fp32 plane, overwritten
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) ids and log-probabilities of each row's K likeliest tokens under
    log_softmax(logits), likeliest first."""
    work = work[: logits.shape[0]]
    work.copy_(logits)
    values, token_ids = torch.topk(work, num_top, dim=-1)  # (N, K)
    row_max = values[:, :1]
    log_sum = work.sub_(row_max).exp_().sum(dim=-1, keepdim=True).log_()
    return token_ids, values - row_max - log_sum


def process_scores_ref(
    logits: torch.Tensor,  # (N, V)
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],  # each row's prompt then outputs, all known
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """`process_scores` in plain torch, a row and a token at a time, in fp32: the reference."""
    out = logits.float().clone()
    for row, p in enumerate(params):
        scores = out[row]
        for token_id, bias in p.logit_bias:
            scores[token_id] += bias
        prompt = list(token_ids[row][: num_prompt_tokens[row]])
        outputs = list(token_ids[row][num_prompt_tokens[row] :])
        if p.repetition_penalty != 1.0:
            for token_id in set(prompt + outputs):
                value = scores[token_id]
                penalty = p.repetition_penalty
                scores[token_id] = value / penalty if value > 0 else value * penalty
        for token_id in set(outputs):
            scores[token_id] -= p.presence_penalty
        for token_id in outputs:
            scores[token_id] -= p.frequency_penalty
        if p.min_p > 0.0 and not p.is_greedy:
            probs = torch.softmax(scores / p.temperature, dim=-1)
            scores[probs < p.min_p * probs.max()] = float("-inf")
    return out
