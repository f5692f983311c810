"""The schema's token masks in the sampler: greedy and sampled rows always pick a token the
schema allows next (checked by an independent matcher), a pending newest token is read from
the step's inputs, and a schema the vocabulary cannot continue ends the reply."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xgrammar
import xgrammar.testing
from transformers import PreTrainedTokenizerFast

from pagekeeper_engine.core.limits import RequestRejectedError
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.runner.grammar_fill import HostRows
from pagekeeper_engine.runner.logits_processing import StepHistory
from pagekeeper_engine.runner.sampler import Sampler
from pagekeeper_engine.runner.structured_output import GrammarMasks, unpack_bitmask
from tests.engine.server.checkpoint import EOS_ID, JSON_VOCAB, VOCAB, write_tokenizer

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    }
)
TOKENS = list(JSON_VOCAB)
PROMPT = [1, 5, 6]


class Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.all_token_ids = token_ids
        self.num_prompt_tokens = len(PROMPT)


def grammar_for(
    tmp_path: Path, vocab: dict[str, int] = JSON_VOCAB, device: str = "cpu"
) -> GrammarMasks:
    write_tokenizer(tmp_path, vocab)
    return GrammarMasks(tmp_path, len(vocab), frozenset({EOS_ID}), 4, torch.device(device))


def generate(
    sampler: Sampler, params: list[SamplingParams], seed: int, device: str = "cpu"
) -> list[list[int]]:
    """Each row's tokens until EOS (at most 60), the newest pending on the host each step."""
    rows = len(params)
    tokens = [list(PROMPT) for _ in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    done = [False] * rows
    for _ in range(60):
        seqs = [Seq([*t[:-1], PLACEHOLDER_TOKEN_ID]) for t in tokens]
        newest = torch.tensor([t[-1] for t in tokens], device=device)
        # as the launcher hands it over: the newest ids' copy to the host started
        history = StepHistory(seqs, newest, torch.arange(rows, device=device)).with_newest_on_host()
        logits = (4 * torch.randn(rows, len(JSON_VOCAB), generator=gen)).to(device)
        token_ids, _ = sampler.sample(logits, params, [len(t) - 3 for t in tokens], history)
        for row, token_id in enumerate(token_ids.tolist()):
            if not done[row]:
                tokens[row].append(token_id)
                done[row] = token_id == EOS_ID
        if all(done):
            break
    return [t[len(PROMPT) :] for t in tokens]


def check_picks_continue_the_schema(tmp_path: Path, temperature: float, device: str) -> None:
    grammar = grammar_for(tmp_path, device=device)
    sampler = Sampler(device, 0, frozenset({EOS_ID}))
    sampler.grammar = grammar
    params = [SamplingParams(temperature=temperature, json_schema=SCHEMA) for _ in range(3)]
    params.append(SamplingParams(temperature=temperature))  # a free row beside them
    outputs = generate(sampler, params, int(temperature * 10), device)
    # an independent matcher: the reference for what the schema allows
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))  # type: ignore[no-untyped-call]
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(JSON_VOCAB), stop_token_ids=[EOS_ID]
    )
    compiler = xgrammar.GrammarCompiler(info)
    for output in outputs[:3]:
        matcher = xgrammar.GrammarMatcher(
            compiler.compile_json_schema(SCHEMA, any_whitespace=False)
        )
        assert all(matcher.accept_token(t) for t in output), output
        assert output[-1] == EOS_ID and matcher.is_terminated()
        value = json.loads("".join(TOKENS[t] for t in output[:-1]))
        assert set(value) == {"ok", "level"} and value["level"] in ("low", "high")
    # the fills on one thread measured a row's fill, which sizes the next fills' threads
    assert grammar.fill_row_seconds is not None and grammar.fill_row_seconds > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_pick_continues_the_schema(tmp_path: Path, temperature: float) -> None:
    check_picks_continue_the_schema(tmp_path, temperature, "cpu")


def test_a_schema_that_does_not_compile_is_refused_naming_response_format(tmp_path: Path) -> None:
    grammar = grammar_for(tmp_path)
    grammar.check(SamplingParams(json_schema=SCHEMA))
    grammar.check(SamplingParams())
    with pytest.raises(RequestRejectedError) as info:
        grammar.check(SamplingParams(json_schema='{"type": 5}'))
    assert info.value.param == "response_format"
    assert str(info.value).startswith("response_format: the JSON schema cannot be enforced")


def test_a_schema_whose_first_token_the_vocabulary_cannot_spell_is_refused(
    tmp_path: Path,
) -> None:
    grammar = grammar_for(tmp_path, VOCAB)  # no braces, no quotes
    for schema in (SCHEMA, '{"type": "object"}'):
        with pytest.raises(RequestRejectedError) as info:
            grammar.check(SamplingParams(json_schema=schema))
        assert info.value.param == "response_format"
        assert "vocabulary has no token" in str(info.value)
    grammar.check(SamplingParams(json_schema='{"type": "integer"}'))  # digits it can spell


def test_unpacked_bitmask_rows_name_exactly_their_tokens() -> None:
    vocab_size = 70  # three words, the last one partly past the vocabulary
    token_ids = [0, 1, 31, 32, 63, 64, 69]
    bool_mask = torch.zeros(1, vocab_size, dtype=torch.bool)
    bool_mask[0, token_ids] = True
    words = xgrammar.testing.bool_mask_to_bitmask(bool_mask)
    assert words.shape == (1, 3)
    unpacked = unpack_bitmask(words[0], vocab_size)
    assert torch.nonzero(unpacked).flatten().tolist() == token_ids


def test_a_row_allows_some_token_when_any_bit_of_any_word_is_set() -> None:
    rows = torch.zeros(5, 3, dtype=torch.int32)  # an odd number of words a row
    rows[1, 2] = -(2**31)  # token 95 alone: the sign bit of the last word
    rows[2, 0] = 1  # token 0 alone
    rows[3] = -1  # every token
    # row 0 and row 4 allow nothing
    assert [HostRows(rows).allows_any(r) for r in range(5)] == [False, True, True, True, False]
    first = HostRows(rows[1:3])  # a step's first rows of the buffer
    assert [first.allows_any(r) for r in range(2)] == [True, True]


def test_host_rows_write_whole_rows_and_single_bits_in_place() -> None:
    buffer = torch.zeros(4, 3, dtype=torch.int32)
    rows = HostRows(buffer[:3])  # the step's rows: the fourth is outside them
    rows.allow_all(1)
    assert buffer[1].tolist() == [-1, -1, -1]
    rows.allow_only(2, frozenset({0, 63, 95}))  # bit 0 of word 0, the sign bits of words 1, 2
    assert buffer[2].tolist() == [1, -(2**31), -(2**31)]
    rows.allow_only(1, frozenset({33}))  # clears what was there first
    assert buffer[1].tolist() == [0, 2, 0]
    assert buffer[0].tolist() == [0, 0, 0] and buffer[3].tolist() == [0, 0, 0]
    assert [rows.allows_any(r) for r in range(3)] == [False, True, True]


def test_a_vocabulary_that_cannot_spell_the_schema_ends_the_reply(tmp_path: Path) -> None:
    grammar = grammar_for(tmp_path, VOCAB)  # no braces, no quotes
    scores = torch.zeros(2, len(VOCAB))
    params = [SamplingParams(json_schema=SCHEMA), SamplingParams()]
    history = StepHistory([Seq(PROMPT), Seq(PROMPT)], torch.tensor([6, 6]), torch.arange(2))
    assert grammar.mask_now(scores, params, history) == [0], "the row is reported cut"
    assert torch.nonzero(scores[0].isfinite()).flatten().tolist() == [EOS_ID]
    assert bool(scores[1].isfinite().all()), "a free row is not masked"


def test_a_batch_of_masks_alone_picks_through_the_bitmask_as_over_masked_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masks alone, rows picking alike: the pick reads the bitmask, and nothing writes it into
    the scores first; the tokens are those of the batch whose masks are written into its
    scores (a zero logit bias on one row sends it that way), seeded rows included."""
    applied: list[int] = []
    apply = xgrammar.apply_token_bitmask_inplace

    def counting_apply(scores: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> None:
        applied.append(scores.shape[0])
        apply(scores, mask, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", counting_apply)

    def tokens_of(params: list[SamplingParams]) -> list[list[int]]:
        sampler = Sampler("cpu", 0, frozenset({EOS_ID}))
        sampler.grammar = grammar_for(tmp_path)  # new matchers: each run starts its replies
        return generate(sampler, params, seed=3)

    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(temperature=temperature, seed=11 + i, json_schema=SCHEMA)
            for i in range(3)
        ]
        params.append(SamplingParams(temperature=temperature, seed=5))  # a free row
        fused = tokens_of(params)
        assert applied == []
        written = tokens_of([replace(params[0], logit_bias=((0, 0.0),)), *params[1:]])
        assert applied and fused == written
        applied.clear()
