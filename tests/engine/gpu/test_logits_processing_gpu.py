"""The logits processors and top alternatives on a GPU, in the model's dtype, through every
pick the sampler has there (greedy, the keyed inverse-CDF pick of a one-temperature batch, the
race of a mixed batch), against the plain torch reference on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.runner.logits_processing import StepHistory, process_scores_ref
from pagekeeper_engine.runner.sampler import Sampler, SamplerBuffers
from tests.engine.cpu.test_structured_deferred import check_deferred_sampling
from tests.engine.cpu.test_structured_output import check_picks_continue_the_schema
from tests.engine.server.checkpoint import JSON_VOCAB, write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 5000
NUM_ROWS = 6


class Seq:
    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.all_token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens


def logits() -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return (3 * torch.randn((NUM_ROWS, VOCAB), generator=gen, device="cuda")).bfloat16()


def token_lists() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in range(NUM_ROWS)]


def history(tokens: list[list[int]]) -> StepHistory:
    """Each newest token pending on the host, its value in the step's inputs on the device."""
    seqs = [Seq([*t[:-1], PLACEHOLDER_TOKEN_ID], 5) for t in tokens]
    inputs = torch.tensor([t[-1] for t in tokens], device="cuda")
    return StepHistory(seqs, inputs, torch.arange(NUM_ROWS, device="cuda"))


PROCESSORS = [
    {"repetition_penalty": 1.6},
    {"presence_penalty": 1.0, "frequency_penalty": 0.7},
    {"logit_bias": ((17, 25.0),)},
    {"repetition_penalty": 0.8, "logit_bias": ((3, -100.0),)},
    {},
    {"frequency_penalty": -0.5},
]


@pytest.mark.parametrize(
    "pick",
    [
        {"temperature": 0.0},  # greedy
        {"temperature": 0.7, "min_p": 1.0},  # the keyed pick; min-p 1 keeps the likeliest only
        {"temperature": 0.7, "min_p": 1.0, "seed": 5},  # the race of seeded rows
    ],
)
def test_the_gpu_picks_the_references_best(pick: dict[str, object]) -> None:
    rows = logits()
    tokens = token_lists()
    params = [SamplingParams(**pick, **extra) for extra in PROCESSORS]  # type: ignore[arg-type]
    buffers = SamplerBuffers(8, VOCAB, torch.bfloat16, "cuda")
    sampler = Sampler("cuda", 0, frozenset(), buffers)
    token_ids, packed = sampler.sample(rows, params, [7] * NUM_ROWS, history(tokens))
    expected = process_scores_ref(rows.cpu(), params, tokens, [5] * NUM_ROWS)
    assert token_ids.cpu().tolist() == expected.argmax(-1).tolist()
    raw = rows.float().log_softmax(-1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(packed[1].float(), raw, rtol=1e-4, atol=1e-4)


def test_min_p_on_the_gpu_never_picks_below_its_floor() -> None:
    rows = logits()
    params = [SamplingParams(temperature=1.2, min_p=0.25)] * NUM_ROWS
    allowed = process_scores_ref(rows.cpu(), params, [[0]] * NUM_ROWS, [1] * NUM_ROWS).isfinite()
    sampler = Sampler("cuda", 0, frozenset(), SamplerBuffers(8, VOCAB, torch.bfloat16, "cuda"))
    seqs = StepHistory(
        [Seq([0], 1)] * NUM_ROWS,
        torch.zeros(1, dtype=torch.long, device="cuda"),
        torch.zeros(NUM_ROWS, dtype=torch.long, device="cuda"),
    )
    for _ in range(50):
        token_ids, _ = sampler.sample(rows, params, [0] * NUM_ROWS, seqs)
        assert allowed.gather(1, token_ids.cpu()[:, None]).all()


def test_top_logprobs_on_the_gpu() -> None:
    rows = logits()
    params = [SamplingParams(temperature=0.8, top_logprobs=k) for k in (0, 4, 20, 1, 0, 2)]
    sampler = Sampler("cuda", 0, frozenset(), SamplerBuffers(8, VOCAB, torch.bfloat16, "cuda"))
    _, packed = sampler.sample(rows, params, [0] * NUM_ROWS)
    assert packed.shape == (2 + 2 * 20, NUM_ROWS)
    values, ids = rows.float().log_softmax(-1).topk(20, dim=-1)
    assert torch.equal(packed[2:22].T.long(), ids)
    torch.testing.assert_close(packed[22:42].T.float(), values, rtol=1e-4, atol=1e-4)


def test_a_plain_batch_has_no_extra_rows_on_the_gpu() -> None:
    sampler = Sampler("cuda", 0, frozenset(), SamplerBuffers(8, VOCAB, torch.bfloat16, "cuda"))
    _, packed = sampler.sample(logits(), [SamplingParams(temperature=0.7)] * NUM_ROWS, [0] * 6)
    assert packed.shape == (2, NUM_ROWS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_schemas_masks_on_the_gpu(tmp_path: Path, temperature: float) -> None:
    """The bitmask copied to the device and applied there (xgrammar's CUDA path)."""
    check_picks_continue_the_schema(tmp_path, temperature, "cuda")


def test_deferred_structured_sampling_on_the_gpu(tmp_path: Path) -> None:
    """A structured step sampled at the next launch (masks from the grammar thread, copied and
    applied on the device) gives the synchronous loop's tokens, every reply a match."""
    write_checkpoint(tmp_path, max_positions=128, vocab=JSON_VOCAB)
    check_deferred_sampling(tmp_path, "cuda")


def test_the_newest_ids_copied_early_wait_for_the_kernels_before_the_copy() -> None:
    """The copy is enqueued once the inputs hold the ids: what the stream runs after it (a
    forward pass) does not change what is read, and reading waits for what ran before."""
    inputs = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
    indices = torch.tensor([3, 1 << 19, (1 << 20) - 1], device="cuda")
    inputs.index_fill_(0, indices, 11)  # enqueued before the copy: the copy sees it
    early = StepHistory([], inputs, indices).with_newest_on_host()
    inputs.fill_(-1)  # enqueued after the copy (the forward pass's place): not seen
    assert early.newest_token_list() == [11, 11, 11]
    assert StepHistory([], inputs, indices).newest_token_list() == [-1, -1, -1]
