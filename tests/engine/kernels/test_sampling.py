from __future__ import annotations

import math

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.kernels.reference import inverse_cdf_ref, uniforms_ref
from pagekeeper_engine.kernels.sampling import BLOCK_V, PickScratch, pick_tokens
from pagekeeper_engine.runner import sampler as sampler_module
from pagekeeper_engine.runner.pick import pick_tokens_ref
from pagekeeper_engine.runner.sampler import Sampler
from pagekeeper_engine.runner.structured_output import unpack_bitmask
from tests.engine.kernels.hopper_compile import compile_for_hopper

# Many chunks at small vocabularies: 63 at V = 1000, as 128,256 has at BLOCK_V.
SMALL_BLOCK_V = 16


def random_logits(
    num_rows: int, vocab_size: int, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return 3 * torch.randn((num_rows, vocab_size), generator=gen, device=device)


def check_against_ref(
    scores: torch.Tensor,
    raw: torch.Tensor,
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
) -> torch.Tensor:
    token_ids, packed = pick_tokens(scores, raw, scale=scale, noise=noise, block_v=block_v)
    ref_ids, ref_packed = pick_tokens_ref(scores, raw, scale=scale, noise=noise)
    assert token_ids.dtype == torch.int64 and packed.dtype == torch.float64
    assert packed.shape == (2, raw.shape[0])
    assert torch.equal(token_ids, ref_ids)
    assert torch.equal(packed[0], token_ids.double())
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=1e-5, atol=1e-5)
    return token_ids


@pytest.mark.parametrize("has_noise", [False, True])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "block_v"),
    [
        (1, 1, BLOCK_V),
        (3, 37, BLOCK_V),
        (5, BLOCK_V + 5, BLOCK_V),
        (1, 3 * BLOCK_V - 1, BLOCK_V),
        (3, 1000, SMALL_BLOCK_V),
    ],
)
def test_pick_matches_torch(
    num_rows: int,
    vocab_size: int,
    block_v: int,
    has_noise: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    raw = random_logits(num_rows, vocab_size, device, generator)
    # Masked tokens, as min_tokens and top-k / top-p leave them; one row entirely.
    is_masked = torch.rand(raw.shape, generator=generator, device=device) < 0.3
    scores = raw.masked_fill(is_masked, float("-inf"))
    scores[-1, : vocab_size // 2] = float("-inf")
    noise = None
    if has_noise:
        noise = torch.empty_like(raw).exponential_(generator=generator)
    check_against_ref(scores, raw, scale=1 / 0.7, noise=noise, block_v=block_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_noise", [False, True])
@pytest.mark.parametrize("is_masked", [False, True])
@pytest.mark.parametrize(("num_rows", "vocab_size"), [(3, 37), (4, 1000)])
def test_low_precision_logits_pick_as_their_fp32_copy(
    num_rows: int,
    vocab_size: int,
    is_masked: bool,
    has_noise: bool,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    # The model's logits in its dtype; scores are those logits themselves, or an fp32 copy
    # with masked tokens (as a min_tokens mask or a top-k / top-p cut writes them).
    raw = random_logits(num_rows, vocab_size, device, generator).to(dtype)
    scores = raw
    if is_masked:
        drop = torch.rand(raw.shape, generator=generator, device=device) < 0.3
        scores = raw.float().masked_fill(drop, float("-inf"))
    noise = None
    if has_noise:
        noise = torch.empty(raw.shape, device=device).exponential_(generator=generator)
    block_v = SMALL_BLOCK_V if vocab_size > BLOCK_V // 2 else BLOCK_V

    token_ids = check_against_ref(scores, raw, scale=1 / 0.7, noise=noise, block_v=block_v)
    wide_ids, wide_packed = pick_tokens(
        scores.float(), raw.float(), scale=1 / 0.7, noise=noise, block_v=block_v
    )

    assert torch.equal(token_ids, wide_ids)
    _, packed = pick_tokens(scores, raw, scale=1 / 0.7, noise=noise, block_v=block_v)
    torch.testing.assert_close(packed[1], wide_packed[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("is_masked", [False, True])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "block_v"),
    [(1, 1, BLOCK_V), (3, 37, BLOCK_V), (2, BLOCK_V + 7, BLOCK_V), (5, 1001, SMALL_BLOCK_V)],
)
def test_a_keyed_pick_inverts_the_cdf_as_the_reference(
    num_rows: int,
    vocab_size: int,
    block_v: int,
    is_masked: bool,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    # One uniform a row, drawn in the kernel from the key (`uniforms_ref`'s), and the row's
    # softmax CDF inverted there: the same tokens as the fp64 reference, masked tokens never.
    raw = random_logits(num_rows, vocab_size, device, generator).bfloat16()
    scores = raw
    if is_masked:
        drop = torch.rand(raw.shape, generator=generator, device=device) < 0.3
        drop[:, 0] = False
        scores = raw.float().masked_fill(drop, float("-inf"))
    key = 2**62 + 12345  # both halves of the key in use
    token_ids, packed = pick_tokens(scores, raw, scale=1 / 0.7, sample_key=key, block_v=block_v)
    uniforms = uniforms_ref(key, num_rows).to(device)
    ref_ids, ref_packed = inverse_cdf_ref(scores, raw, scale=1 / 0.7, uniforms=uniforms)
    assert torch.equal(token_ids, ref_ids)
    assert torch.equal(packed[0], token_ids.double())
    torch.testing.assert_close(packed[1], ref_packed[1], rtol=1e-5, atol=1e-5)
    if is_masked:
        assert bool(torch.isfinite(scores.float().gather(1, token_ids[:, None])).all())


def random_bitmask(
    num_rows: int, vocab_size: int, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """(N, ceil(V / 32)) int32 words of random bits, every word's sign bit among them; token 0
    always allowed (a row allowing nothing picks token 0 either way)."""
    words = torch.randint(
        -(2**31), 2**31, (num_rows, -(-vocab_size // 32)), generator=gen, device=device
    ).to(torch.int32)
    words[:, 0] |= 1
    return words


@pytest.mark.parametrize("rule", ["argmax", "race", "key"])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "block_v"),
    [(1, 1, BLOCK_V), (3, 37, BLOCK_V), (2, 64, SMALL_BLOCK_V), (4, 1000, SMALL_BLOCK_V)],
)
def test_a_pick_through_a_bitmask_is_the_pick_over_masked_scores(
    rule: str,
    num_rows: int,
    vocab_size: int,
    block_v: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    # The schemas' bitmask read where the scores are: the same tokens as the pick over scores
    # with -inf at every clear bit, never a masked token, and raw's log-probabilities.
    raw = random_logits(num_rows, vocab_size, device, generator).bfloat16()
    bitmask = random_bitmask(num_rows, vocab_size, device, generator)
    allowed = unpack_bitmask(bitmask, vocab_size)
    assert allowed.shape == raw.shape
    masked = raw.float().masked_fill(~allowed, float("-inf"))
    noise = None
    if rule == "race":
        noise = torch.empty(raw.shape, device=device).exponential_(generator=generator)
    key = 2**61 + 99 if rule == "key" else None
    options = {"scale": 1 / 0.7, "noise": noise, "sample_key": key, "block_v": block_v}
    token_ids, packed = pick_tokens(raw, raw, bitmask=bitmask, **options)  # type: ignore[arg-type]
    want_ids, want_packed = pick_tokens(masked, raw, **options)  # type: ignore[arg-type]
    assert torch.equal(token_ids, want_ids)
    torch.testing.assert_close(packed, want_packed, rtol=0, atol=0)
    assert bool(allowed.gather(1, token_ids[:, None]).all())
    if rule != "key":  # the reference races: it has no keyed pick
        ref_ids, ref_packed = pick_tokens_ref(raw, raw, scale=1 / 0.7, noise=noise, bitmask=bitmask)
        assert torch.equal(token_ids, ref_ids)
        torch.testing.assert_close(packed[1], ref_packed[1], rtol=1e-5, atol=1e-5)


def test_a_pick_refuses_a_bitmask_that_does_not_cover_its_rows(device: torch.device) -> None:
    raw = torch.zeros(2, 70, device=device)
    for bad, message in [
        (torch.zeros(2, 2, dtype=torch.int32, device=device), "does not cover"),
        (torch.zeros(1, 3, dtype=torch.int32, device=device), "does not cover"),
        (torch.zeros(2, 3, dtype=torch.int64, device=device), "expected torch.int32"),
        (torch.zeros(3, 2, dtype=torch.int32, device=device).T, "contiguous"),
    ]:
        with pytest.raises(AssertionError, match=message):
            pick_tokens(raw, raw, bitmask=bad)


def test_a_keyed_pick_at_the_edges_of_the_cdf(device: torch.device) -> None:
    # A row of one live token picks it at any uniform, a row of no mass picks token 0 (as the
    # argmax of an all -inf row), and the first and the last live tokens are reachable.
    inf = float("inf")
    scores = torch.tensor(
        [[-inf, -inf, 3.0, -inf], [-inf, -inf, -inf, -inf], [0.0, -inf, -inf, 0.0]],
        device=device,
    )
    raw = torch.zeros_like(scores)
    picked = set()
    for key in range(40):
        token_ids, _ = pick_tokens(scores, raw, scale=1.0, sample_key=key, block_v=16)
        assert token_ids[:2].tolist() == [2, 0]
        picked.add(int(token_ids[2]))
    assert picked == {0, 3}


def test_inverting_the_cdf_samples_the_softmax() -> None:
    # 4,000 rows of the same six logits, each with its own uniform (the kernel's, exactly: the
    # test above): the picks come at softmax(logits / T)'s frequencies (a chi-square test at
    # p = 1e-4 on one fixed key, so it cannot flake).
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    num_rows, temperature = 4000, 1.3
    raw = logits.expand(num_rows, -1).contiguous()
    token_ids, _ = inverse_cdf_ref(
        raw, raw, scale=1 / temperature, uniforms=uniforms_ref(7, num_rows)
    )
    counts = torch.bincount(token_ids, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * num_rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 25.7, (counts.tolist(), expected.tolist())  # 5 d.o.f., p = 1e-4


def test_the_uniforms_are_uniform_and_differ_by_key() -> None:
    draws = uniforms_ref(11, 100_000)
    assert draws.dtype == torch.float32 and bool(((draws >= 0) & (draws < 1)).all())
    histogram = torch.histc(draws, bins=10, min=0.0, max=1.0)
    assert float(((histogram - 10_000) ** 2 / 10_000).sum()) < 33.7  # 9 d.o.f., p = 1e-4
    assert not torch.equal(draws, uniforms_ref(12, 100_000))
    assert torch.equal(draws[:100], uniforms_ref(11, 100))


def test_picks_over_one_scratch_write_its_rows(
    device: torch.device, generator: torch.Generator
) -> None:
    # Steps of 3 rows, then 1, then 4 (the scratch's capacity) pick into the scratch's leading
    # rows: what each returns is its rows of the scratch, and equals a pick into new tensors.
    scratch = PickScratch(4, 300, device, block_v=64)
    assert scratch.num_chunks == 5
    for num_rows in (3, 1, 4):
        raw = random_logits(num_rows, 300, device, generator)
        noise = torch.empty_like(raw).exponential_(generator=generator)
        token_ids, packed = pick_tokens(raw, raw, scale=1 / 0.7, noise=noise, scratch=scratch)
        assert token_ids.data_ptr() == scratch.token_ids.data_ptr()
        assert packed.data_ptr() == scratch.packed.data_ptr() and packed.is_contiguous()
        fresh_ids, fresh_packed = pick_tokens(raw, raw, scale=1 / 0.7, noise=noise, block_v=64)
        assert torch.equal(token_ids, fresh_ids) and torch.equal(packed, fresh_packed)
        # The one launch's arrival counters are zero again for the next pick.
        assert not scratch.counters.any()


def test_a_scratch_refuses_what_it_was_not_made_for(device: torch.device) -> None:
    scratch = PickScratch(2, 300, device, block_v=64)
    cases = [
        ((3, 300), {}, "3 rows exceed the scratch's 2"),
        ((1, 400), {}, "made for 5 chunks of 64, raw has a vocabulary of 400"),
        ((1, 300), {"block_v": 16}, "block_v 16 differs from the scratch's 64"),
    ]
    for shape, extra, message in cases:
        raw = torch.zeros(shape, device=device)
        with pytest.raises(AssertionError, match=message):
            pick_tokens(raw, raw, scratch=scratch, **extra)
    # A scratch for several ranks' partials picks in two launches around their gather.
    shards = PickScratch(2, 300, device, block_v=64, ranks=2)
    raw = torch.zeros((1, 300), device=device)
    with pytest.raises(AssertionError, match="several ranks"):
        pick_tokens(raw, raw, scratch=shards)


def test_a_zero_draw_is_read_at_the_floor(device: torch.device) -> None:
    # A draw of exactly 0 races at -log(tiny) ~ 87.3, not +inf: two such draws still rank by
    # their scores, and a masked token with one stays at -inf (not -inf + inf = NaN).
    inf = float("inf")
    scores = torch.tensor([[0.0, 1.0, -inf], [0.0, -inf, -80.0], [5.0, -inf, 0.0]], device=device)
    noise = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 1.0]], device=device)

    token_ids = check_against_ref(scores, torch.zeros_like(scores), noise=noise)

    assert token_ids.tolist() == [1, 2, 0]


def test_pick_over_strided_rows(device: torch.device, generator: torch.Generator) -> None:
    raw = random_logits(8, 300, device, generator)[::2]
    noise = torch.empty((8, 300), device=device).exponential_(generator=generator)[1::2]
    check_against_ref(raw, raw, scale=2.0, noise=noise, block_v=64)


@pytest.mark.parametrize("block_v", [SMALL_BLOCK_V, BLOCK_V])
def test_ties_go_to_the_lowest_index(block_v: int, device: torch.device) -> None:
    vocab_size = 3 * block_v - 1
    scores = torch.zeros((5, vocab_size), device=device)
    scores[0, [2 * block_v + 1, block_v + 3, 7]] = 5.0  # across chunks: 7 wins
    scores[1, [block_v - 1, block_v]] = 5.0  # the last of chunk 0, the first of chunk 1
    scores[2, :] = float("-inf")
    scores[2, vocab_size - 1] = -1e30  # -inf never wins over a finite score
    scores[3, :] = float("-inf")  # nothing finite: index 0, as torch.argmax
    # Row 4, all zeros: index 0.

    token_ids = check_against_ref(scores, torch.zeros_like(scores), block_v=block_v)

    assert token_ids.tolist() == [7, block_v - 1, vocab_size - 1, 0, 0]


def test_noise_can_overturn_the_argmax(device: torch.device) -> None:
    scores = torch.tensor([[2.0, 1.0, 0.0]], device=device)
    noise = torch.tensor([[1.0, math.exp(-2.0), 1.0]], device=device)  # -log: 0, 2, 0

    token_ids, packed = pick_tokens(scores, torch.zeros_like(scores), scale=1.0, noise=noise)

    assert token_ids.tolist() == [1]
    assert packed.tolist() == [[1.0], [pytest.approx(-math.log(3.0), abs=1e-6)]]
    # At scale 2 the first token's lead (4) outruns the noise (3).
    assert pick_tokens(scores, scores, scale=2.0, noise=noise)[0].tolist() == [0]


def test_pick_of_no_rows(device: torch.device) -> None:
    token_ids, packed = pick_tokens(*[torch.empty((0, 50), device=device)] * 2)
    assert token_ids.shape == (0,) and packed.shape == (2, 0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda d: {"raw": torch.zeros(8, device=d)}, "raw must be"),
        (lambda d: dict.fromkeys(("raw", "scores"), torch.zeros((2, 0), device=d)), "empty"),
        (lambda d: {"scores": torch.zeros((2, 7), device=d)}, "scores shape"),
        (lambda d: {"scores": torch.zeros((2, 8), dtype=torch.float16, device=d)}, "float32"),
        (lambda d: {"raw": torch.zeros((2, 8), dtype=torch.float64, device=d)}, "raw is"),
        (
            lambda d: {
                "scores": torch.zeros((2, 8), dtype=torch.float16, device=d),
                "raw": torch.zeros((2, 8), dtype=torch.bfloat16, device=d),
            },
            "scores is",
        ),
        (lambda d: {"scores": torch.zeros((8, 2), device=d).t()}, "contiguous"),
        (lambda d: {"noise": torch.ones((3, 8), device=d)}, "noise shape"),
        (lambda d: {"scale": 0.0}, "scale"),
        (lambda d: {"scale": math.inf}, "scale"),
        (lambda d: {"block_v": 48}, "block_v"),
    ],
)
def test_pick_rejects_bad_inputs(bad: object, message: str, device: torch.device) -> None:
    assert callable(bad)
    args = {"scores": torch.zeros((2, 8), device=device), "raw": torch.zeros((2, 8), device=device)}
    with pytest.raises(AssertionError, match=message):
        pick_tokens(**{**args, **bad(device)})


SAMPLER_BATCHES = {
    "greedy": [SamplingParams(temperature=0.0)] * 3,
    "random": [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=5)] * 2,
    "cut": [SamplingParams(temperature=0.8, top_k=20, top_p=0.9)] * 3,
    "min_tokens": [SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(2, 7))] * 2,
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_p=0.8)],
}


@pytest.mark.parametrize("batch", SAMPLER_BATCHES)
def test_the_sampler_over_bf16_logits_picks_as_over_fp32(
    batch: str, device: torch.device, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every sampler path through the kernel (the CPU's sampler would take the reference): the
    # model's bf16 logits as they come, or copied to fp32 first, give the same picks.
    monkeypatch.setattr(sampler_module, "pick_tokens", pick_tokens)
    params = SAMPLER_BATCHES[batch]
    low = random_logits(len(params), 300, device, generator).bfloat16()
    num_output_tokens = [1] * len(params)

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sampler = Sampler(device, seed=3, eos_token_ids=frozenset({5}))
        return sampler.sample(logits, params, num_output_tokens)

    token_ids, packed = sample(low)
    wide_ids, wide_packed = sample(low.float())

    assert torch.equal(token_ids, wide_ids)
    torch.testing.assert_close(packed[1], wide_packed[1], rtol=1e-6, atol=1e-6)
    if batch == "min_tokens":
        assert not set(token_ids.tolist()) & {2, 5, 7}


def test_the_pick_compiles_for_hopper() -> None:
    # The interpreter runs what the compiler refuses (a module global read inside a kernel
    # that is not a constexpr, for one), so both launches are also compiled for sm_90, with or
    # without a GPU, in a process where the interpreter is off.
    assert compile_for_hopper("pick") == ["compiled", "1", "2", "4"]
