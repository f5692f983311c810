from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.runner.pick import pick_tokens
from pagekeeper_engine.runner.sampler import Sampler
from pagekeeper_engine.runner.top_k_top_p import CutScratch, apply_top_k_top_p

EOS = 3


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler("cpu", seed=seed, eos_token_ids=frozenset({EOS}))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_greedy_is_argmax_and_logprob_is_the_models() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 2.9, 0.0, -5.0]])
    out = make_sampler()(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert out.token_ids == [1, 0]
    expected = logits.log_softmax(-1)
    assert out.logprobs == pytest.approx([float(expected[0, 1]), float(expected[1, 0])])


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 5
    out = make_sampler()(logits, params, [0] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    logits = log_probs(0.12, 0.5, 0.05, 0.25, 0.08).repeat(4, 1)
    top_p = torch.tensor([0.45, 0.6, 0.8, 0.9])
    kept = apply_top_k_top_p(logits, top_k=torch.zeros(4, dtype=torch.long), top_p=top_p)
    # Sorted: 0.5 (id 1), 0.25 (id 3), 0.12 (id 0), 0.08 (id 4), 0.05 (id 2); the mass before
    # each is 0, .5, .75, .87, .95.
    assert [row.isfinite().nonzero().flatten().tolist() for row in kept] == [
        [1],
        [1, 3],
        [0, 1, 3],
        [0, 1, 3, 4],
    ]
    # Kept logits are untouched.
    assert torch.equal(kept[3, [0, 1, 3, 4]], logits[3, [0, 1, 3, 4]])


def test_top_k_then_top_p_renormalised() -> None:
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # After top-2 the mass is 0.4/0.7 and 0.3/0.7: top-p 0.5 keeps only the first.
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5])).isfinite()
    assert kept[0].tolist() == [True, False, False, False]
    kept = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0])).isfinite()
    assert kept[0].tolist() == [True, True, True, False]


def test_samples_only_from_the_nucleus_with_the_right_frequencies() -> None:
    num_rows = 4000
    logits = log_probs(0.12, 0.5, 0.05, 0.25, 0.08).repeat(num_rows, 1)
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * num_rows
    out = make_sampler(seed=7)(logits, params, [0] * num_rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    # Renormalised nucleus: 0.5 / 0.75 and 0.25 / 0.75.
    assert abs(counts[1].item() / num_rows - 2 / 3) < 0.03


def test_temperature_sharpens() -> None:
    num_rows = 3000
    logits = log_probs(0.6, 0.4).repeat(num_rows, 1)
    out = make_sampler(seed=3)(logits, [SamplingParams(temperature=0.5)] * num_rows, [0] * num_rows)
    # p^2 normalised: 0.36 / 0.52.
    share = out.token_ids.count(0) / num_rows
    assert abs(share - 0.36 / 0.52) < 0.03


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    alone = [make_sampler(0)(logits, [seeded], [n]).token_ids[0] for n in range(8)]
    batched = [
        make_sampler(99)(logits.repeat(3, 1), [other, seeded, other], [5, n, 0]).token_ids[1]
        for n in range(8)
    ]
    assert alone == batched
    assert len(set(alone)) > 1  # the step count moves the generator on


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = torch.zeros(6, 1000)
    params = [SamplingParams(temperature=1.0)] * 6
    first = make_sampler(5)(logits, params, [0] * 6).token_ids
    assert first == make_sampler(5)(logits, params, [0] * 6).token_ids
    assert first != make_sampler(6)(logits, params, [0] * 6).token_ids


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 1.0, 10.0, 9.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    sampler = make_sampler()
    assert sampler(logits, [params], [0]).token_ids == [2]
    assert sampler(logits, [params], [2]).token_ids == [EOS]
    # The logprob is that of the model's distribution, before the min_tokens mask.
    lp = sampler(logits, [params], [0]).logprobs[0]
    assert lp == pytest.approx(float(logits.log_softmax(-1)[0, 2]), abs=1e-6)


def test_fused_and_mixed_paths_pick_the_same_tokens() -> None:
    # On the CPU one temperature goes straight to the pick (scale 1 / T, noise); a greedy row
    # beside the same rows sends them through the scores built in torch. The unseeded rows draw
    # the same noise either way. (On CUDA the first batch inverts the CDF in the pick instead:
    # tests/engine/gpu/test_sampler_gpu.py.)
    num_rows = 64
    logits = torch.randn(num_rows + 1, 300, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9)] * num_rows
    fused = make_sampler(11)(logits[:num_rows], params, [0] * num_rows)
    mixed = make_sampler(11)(logits, [*params, SamplingParams(temperature=0.0)], [0] * 65)
    assert mixed.token_ids[:num_rows] == fused.token_ids
    assert mixed.logprobs[:num_rows] == fused.logprobs
    assert mixed.token_ids[num_rows] == int(logits[num_rows].argmax())
    assert fused.token_ids != logits[:num_rows].argmax(-1).tolist()  # sampled, not greedy


def test_the_cut_in_chunks_of_rows_equals_the_cut_at_once() -> None:
    logits = torch.randn(10, 97, generator=torch.Generator().manual_seed(8))
    top_k = torch.tensor([0, 1, 5, 97, 200, 0, 3, 0, 50, 2])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 1.0, 0.7, 1.0, 0.05, 0.99, 0.6])
    whole = apply_top_k_top_p(logits, top_k, top_p, scale=1.3, scratch=CutScratch(10, 97, "cpu"))
    chunked = apply_top_k_top_p(logits, top_k, top_p, scale=1.3, scratch=CutScratch(3, 97, "cpu"))
    assert torch.equal(whole, chunked)
    # In place, into the logits themselves, gives the same.
    in_place = logits.clone()
    apply_top_k_top_p(
        in_place, top_k, top_p, scale=1.3, out=in_place, scratch=CutScratch(4, 97, "cpu")
    )
    assert torch.equal(in_place, whole)
    assert int(whole.isfinite().sum(-1)[1]) == 1  # top-k 1


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.0)] * 4,
        [SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.7)] * 2,
        [SamplingParams(temperature=0.9, top_k=30, top_p=0.8)] * 4,
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, min_tokens=3)] * 2,
    ],
)
def test_logits_in_the_models_dtype_pick_as_their_fp32_copy(
    params: list[SamplingParams],
) -> None:
    low = torch.randn(4, 200, generator=torch.Generator().manual_seed(6)).bfloat16()
    out = make_sampler(2)(low, params, [0, 1, 2, 3])
    wide = make_sampler(2)(low.float(), params, [0, 1, 2, 3])
    assert out.token_ids == wide.token_ids
    assert out.logprobs == pytest.approx(wide.logprobs, rel=1e-6, abs=1e-6)


def test_a_keyed_pick_is_refused_on_the_cpu() -> None:
    # The key's inverse CDF is the CUDA kernel's rule; the CPU's pick races and says so.
    logits = torch.zeros(2, 8)
    with pytest.raises(AssertionError, match="keyed pick runs in the CUDA kernel"):
        pick_tokens(logits, logits, scale=1.0, sample_key=3)
