"""The engine's logits equal Hugging Face transformers' on the same random-weight checkpoint.

Each case writes a tiny checkpoint with `save_pretrained`, loads it through the engine's runner
(paged KV cache, torch reference attention) and compares every computed row with the
transformers forward over the whole sequence, whose row p depends only on tokens <= p.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import (
    TOLERANCE,
    hf_logits,
    make_runner,
    seq,
    step_logits,
    tokens,
    write_checkpoint,
)

CASES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_theta": 500.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.5}}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, ModelRunner]:
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = write_checkpoint(path, arch, **overrides)
    return hf, make_runner(path)


def test_prefill_matches(pair: tuple[PreTrainedModel, ModelRunner]) -> None:
    hf, runner = pair
    prompt = tokens(19)
    (ours,) = step_logits(runner, [seq("a", prompt, 0, [0, 1, 2])])
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=TOLERANCE, rtol=TOLERANCE)


def test_chunked_prefill_then_decode_matches(pair: tuple[PreTrainedModel, ModelRunner]) -> None:
    hf, runner = pair
    full = tokens(26, offset=11)
    expected = hf_logits(hf, full)
    blocks = [3, 7, 5, 9]  # deliberately out of order: the block table is what counts
    got = []
    for start, end in ((0, 6), (6, 13), (13, 20)):  # chunks cross block boundaries
        (chunk,) = step_logits(runner, [seq("b", full[start:end], start, blocks)])
        got.append(chunk)
    for pos in range(20, 26):
        (row,) = step_logits(runner, [seq("b", [full[pos]], pos, blocks)])
        got.append(row)
    torch.testing.assert_close(torch.cat(got), expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_decode_after_prefix_cache_hit_matches(pair: tuple[PreTrainedModel, ModelRunner]) -> None:
    hf, runner = pair
    shared = tokens(16, offset=5)  # exactly two full blocks
    first = [*shared, 40, 41, 42]
    step_logits(runner, [seq("first", first, 0, [10, 11, 12])])
    # The second request finds blocks 10 and 11 already holding its prefix: it starts at 16.
    second = [*shared, 60, 61, 62, 63, 64]
    (ours,) = step_logits(runner, [seq("second", second[16:], 16, [10, 11, 13])])
    expected = hf_logits(hf, second)
    torch.testing.assert_close(ours, expected[16:], atol=TOLERANCE, rtol=TOLERANCE)
    (decoded,) = step_logits(runner, [seq("second", [70], 21, [10, 11, 13])])
    torch.testing.assert_close(
        decoded, hf_logits(hf, [*second, 70])[21:], atol=TOLERANCE, rtol=TOLERANCE
    )


def test_mixed_batch_matches_each_alone(pair: tuple[PreTrainedModel, ModelRunner]) -> None:
    """Two decodes and a prefill chunk in one step, as the scheduler packs them."""
    hf, runner = pair
    a, b, c = tokens(9, offset=1), tokens(12, offset=2), tokens(15, offset=4)
    step_logits(runner, [seq("a", a[:8], 0, [14, 15]), seq("b", b[:11], 0, [16, 17])])
    out_a, out_b, out_c = step_logits(
        runner,
        [seq("a", a[8:], 8, [14, 15]), seq("b", b[11:], 11, [16, 17]), seq("c", c, 0, [18, 19])],
    )
    torch.testing.assert_close(out_a, hf_logits(hf, a)[8:], atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(out_b, hf_logits(hf, b)[11:], atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(out_c, hf_logits(hf, c), atol=TOLERANCE, rtol=TOLERANCE)


def test_execute_samples_hf_argmax_with_its_logprob(
    pair: tuple[PreTrainedModel, ModelRunner],
) -> None:
    hf, runner = pair
    prompt = tokens(10, offset=8)
    generated: list[int] = []
    logprobs: list[float] = []
    step = SchedulerOutput(seqs=[seq("g", prompt, 0, [20, 21, 22])], num_batched_tokens=10)
    for i in range(4):
        out = runner.execute(step)
        token, logprob = out.sampled_token_ids[0], out.logprobs[0]
        assert token is not None and logprob is not None
        generated.append(token)
        logprobs.append(logprob)
        pos = len(prompt) + i
        step = SchedulerOutput(seqs=[seq("g", [token], pos, [20, 21, 22])], num_batched_tokens=1)
    full = hf_logits(hf, prompt + generated)
    expected_ids = full[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    assert generated == expected_ids
    expected_lp = full[len(prompt) - 1 : -1].log_softmax(dim=-1)
    for i, token in enumerate(generated):
        assert logprobs[i] == pytest.approx(float(expected_lp[i, token]), abs=TOLERANCE)


def test_sharded_checkpoint_matches(tmp_path: Path) -> None:
    hf = write_checkpoint(tmp_path, "llama", max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    runner = make_runner(tmp_path, num_blocks=9)
    prompt = tokens(12)
    (ours,) = step_logits(runner, [seq("s", prompt, 0, [2, 0])])
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=TOLERANCE, rtol=TOLERANCE)
