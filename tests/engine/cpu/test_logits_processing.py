"""The logits processors (bias, penalties, min-p) and top alternatives against their plain
torch references, through the sampler, and the untouched path of a batch that uses none."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.runner import sampler as sampler_module
from pagekeeper_engine.runner.logits_processing import (
    StepHistory,
    process_scores,
    process_scores_ref,
    top_logprobs,
)
from pagekeeper_engine.runner.sampler import Sampler, SamplerBuffers
from pagekeeper_engine.runner.top_k_top_p import CutScratch

VOCAB = 37
EOS = 2


class Seq:
    """A sampled row's sequence as the runner sees it (`TokenHistory`)."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.all_token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def history_of(
    token_ids: list[list[int]], num_prompt: list[int], *, pending: bool = False
) -> StepHistory:
    """A step whose sampled rows are the last input of each sequence; with `pending`, each
    newest token is a placeholder on the host, its value only in the step's inputs."""
    seqs = []
    inputs = []
    for tokens, n in zip(token_ids, num_prompt, strict=True):
        host = list(tokens)
        if pending:
            host[-1] = PLACEHOLDER_TOKEN_ID
        seqs.append(Seq(host, n))
        inputs += [5, tokens[-1]]  # another row of the step, then the sampled one
    rows = torch.arange(1, 2 * len(token_ids), 2)
    return StepHistory(seqs, torch.tensor(inputs), rows)


ROWS = [
    SamplingParams(temperature=0.0, logit_bias=((4, 30.0), (9, -100.0))),
    SamplingParams(temperature=0.7, repetition_penalty=1.7),
    SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=0.9),  # none: unchanged beside the others
    SamplingParams(
        temperature=0.5,
        repetition_penalty=0.6,
        presence_penalty=-0.5,
        frequency_penalty=1.0,
        min_p=0.05,
        logit_bias=((1, 2.5),),
    ),
]
TOKENS = [
    [3, 4, 5, 6],
    [7, 8, 7, 9, 9, 10],
    [11, 12, 13, 13, 13, 14],
    [15, 16],
    [17, 18, 19],
    [20, 21, 22, 20, 22, 22, 23],
]
NUM_PROMPT = [2, 3, 3, 2, 3, 2]


def processed(pending: bool) -> torch.Tensor:
    logits = random_logits(len(ROWS))
    scores = logits.clone()
    planes = torch.empty(2, len(ROWS), VOCAB)
    history = history_of(TOKENS, NUM_PROMPT, pending=pending)
    process_scores(scores, ROWS, history, planes[0], planes[1], CutScratch(2, VOCAB, "cpu"))
    return scores


@pytest.mark.parametrize("pending", [False, True])
def test_processors_match_the_reference(pending: bool) -> None:
    expected = process_scores_ref(random_logits(len(ROWS)), ROWS, TOKENS, NUM_PROMPT)
    got = processed(pending)
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert int(got[3].isfinite().sum()) < VOCAB, "min-p dropped some of row 3's tokens"
    assert torch.equal(got[4], random_logits(len(ROWS))[4]), "a row with none is untouched"


def test_the_sampler_picks_from_the_processed_scores() -> None:
    logits = random_logits(len(ROWS))
    greedy = [dataclasses.replace(p, temperature=0.0) for p in ROWS]
    sampler = Sampler("cpu", 0, frozenset({EOS}))
    history = history_of(TOKENS, NUM_PROMPT, pending=True)
    token_ids, packed = sampler.sample(logits, greedy, [2] * len(ROWS), history)
    expected = process_scores_ref(logits, greedy, TOKENS, NUM_PROMPT).argmax(-1)
    assert token_ids.tolist() == expected.tolist()
    assert int(token_ids[0]) == 4, "a +30 bias wins the greedy pick"
    # the logprob stays the model's own
    raw = logits.log_softmax(-1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(packed[1], raw.double(), rtol=1e-5, atol=1e-5)


def test_sampled_rows_never_pick_what_min_p_or_a_bias_removed() -> None:
    logits = random_logits(8, seed=3)
    params = [SamplingParams(temperature=1.5, min_p=0.3, logit_bias=((0, -100.0),))] * 8
    sampler = Sampler("cpu", 0, frozenset({EOS}))
    allowed = process_scores_ref(logits, params, [[1]] * 8, [1] * 8).isfinite()
    allowed[:, 0] = False  # -100 leaves it finite but never sampled at these scales
    for _ in range(20):
        token_ids, _ = sampler.sample(logits, params, [0] * 8, history_of([[1]] * 8, [1] * 8))
        assert allowed.gather(1, token_ids[:, None]).all()


def test_top_logprobs_are_the_models_likeliest() -> None:
    logits = random_logits(4).bfloat16()
    params = [SamplingParams(temperature=0.0, top_logprobs=k) for k in (3, 0, 5, 1)]
    _, packed = Sampler("cpu", 0, frozenset()).sample(logits, params, [0] * 4)
    assert packed.shape == (2 + 2 * 5, 4)
    expected_values, expected_ids = logits.float().log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(packed[2:7].T.long(), expected_ids)
    torch.testing.assert_close(packed[7:12].T.float(), expected_values)
    ids, values = top_logprobs(logits, 2, torch.empty(4, VOCAB))
    assert torch.equal(ids, expected_ids[:, :2])
    torch.testing.assert_close(values, expected_values[:, :2])


def test_a_batch_without_processors_takes_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a plain batch must not be processed")

    monkeypatch.setattr(sampler_module, "process_scores", refuse)
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.8, seed=1),
    ]
    buffers = SamplerBuffers(4, VOCAB, torch.float32, "cpu")
    token_ids, packed = Sampler("cpu", 0, frozenset(), buffers).sample(logits, params, [0] * 3)
    assert packed.shape == (2, 3)
    assert int(token_ids[0]) == int(logits[0].argmax())


def test_the_newest_ids_read_on_the_host_with_or_without_the_early_copy() -> None:
    inputs = torch.tensor([5, 9, 2, 7, 4])
    history = StepHistory([], inputs, torch.tensor([1, 3, 4]))
    assert history.newest_token_list() == [9, 7, 4]
    early = history.with_newest_on_host()
    assert early.newest_on_host is not None and history.newest_on_host is None
    assert early.newest_token_list() == [9, 7, 4]
