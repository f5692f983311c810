"""The schemas' masks made off the step loop's thread: exact bitmasks from the grammar thread's
fill, a matcher that takes the previous step's sampled token before it masks the next (the
token still pending in the sequence's list), a step's sampling deferred to the next launch with
the same tokens as the synchronous loop, and a reply the vocabulary cannot finish ending as cut
("length"), never as a complete match."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import xgrammar

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import EngineOutput
from pagekeeper_engine.runner.grammar_fill import FillJob, MatcherState, fill_step_masks
from pagekeeper_engine.runner.grammar_timing import FillTimes
from pagekeeper_engine.runner.step_results import DeferredStep
from pagekeeper_engine.runner.structured_output import GrammarMasks, unpack_bitmask
from tests.engine.checkpoints import make_runner
from tests.engine.cpu.test_structured_output import PROMPT, SCHEMA, Seq, grammar_for
from tests.engine.fakes import run_all, tokens_of
from tests.engine.server.checkpoint import EOS_ID, JSON_VOCAB, write_checkpoint

TOKENS = list(JSON_VOCAB)
V = len(JSON_VOCAB)


def ids(text: str) -> list[int]:
    return [JSON_VOCAB[c] for c in text]


def allowed(row: torch.Tensor) -> set[str]:
    return {TOKENS[t] for t in torch.nonzero(unpack_bitmask(row, V)).flatten().tolist()}


def job_for(grammar: GrammarMasks, outputs: list[list[int]], newest: list[int]) -> FillJob:
    """One row per output list, each a structured row whose newest output is pending."""
    compiled = grammar.compile(SCHEMA)
    rows = list(range(len(outputs)))
    return FillJob(
        host=xgrammar.allocate_token_bitmask(len(outputs), V),
        rows=rows,
        states=[MatcherState(xgrammar.GrammarMatcher(compiled)) for _ in rows],
        token_lists=[[*PROMPT, *out] for out in outputs],
        num_prompt_tokens=[len(PROMPT)] * len(rows),
        num_output_tokens=[len(out) for out in outputs],
        newest_token_ids=lambda: newest,
    )


def test_filled_bitmasks_allow_exactly_what_the_schema_allows_next(tmp_path: Path) -> None:
    grammar = grammar_for(tmp_path)
    pending = PLACEHOLDER_TOKEN_ID
    prefix = '{"ok": true, "level": '  # xgrammar's compact separators are ", " and ": "
    outputs = [[], [pending], [*ids('{"ok'), pending], [*ids(prefix), pending]]
    newest = [PROMPT[-1], *ids('{""')]
    batch = xgrammar.BatchGrammarMatcher(max_threads=1)
    job = job_for(grammar, outputs, newest)
    assert fill_step_masks(job, batch, frozenset({EOS_ID})) == []
    assert [allowed(row) for row in job.host] == [{"{"}, {'"'}, {":"}, {"l", "h"}]
    # each matcher has taken its newest token, and next takes only the new one
    assert [s.num_accepted for s in job.states] == [0, 1, 5, len(prefix) + 1]
    follow = FillJob(
        job.host, job.rows, job.states,
        [[*PROMPT, *out[:-1], n, pending] for out, n in zip(outputs, newest, strict=True)],
        job.num_prompt_tokens, [n + 1 for n in job.num_output_tokens],
        lambda: [*ids('{":'), EOS_ID],
    )  # fmt: skip
    assert fill_step_masks(follow, batch, frozenset({EOS_ID})) == [3], "EOS was not allowed"
    assert [allowed(row) for row in follow.host[:3]] == [{'"'}, {"o"}, {" "}]
    assert allowed(follow.host[3]) == {"</s>"}


def test_a_match_ended_by_its_end_token_is_held_there_not_cut(tmp_path: Path) -> None:
    # The matcher's termination is read from the token it took, not asked of it row by row.
    grammar = grammar_for(tmp_path)
    pending = PLACEHOLDER_TOKEN_ID
    done = '{"ok": true, "level": "low"}'
    job = job_for(
        grammar, [[*ids(done), pending], [*ids('{"ok'), pending]], [EOS_ID, JSON_VOCAB['"']]
    )
    batch = xgrammar.BatchGrammarMatcher(max_threads=1)
    times = FillTimes()
    assert fill_step_masks(job, batch, frozenset({EOS_ID}), times) == []
    assert times.bitmask_rows == 1, "the batch fill filled the live row only"
    assert [s.is_terminated for s in job.states] == [True, False]
    assert job.states[0].matcher.is_terminated() and not job.states[0].is_stuck
    assert allowed(job.host[0]) == {"</s>"} and allowed(job.host[1]) == {":"}
    # Nothing after the end is taken, so a launch that still carried the row cuts nothing.
    late = FillJob(
        job.host, job.rows, job.states, [[*t, 0] for t in job.token_lists],
        job.num_prompt_tokens, [n + 1 for n in job.num_output_tokens],
        lambda: [JSON_VOCAB["{"], JSON_VOCAB[":"]],
    )  # fmt: skip
    assert fill_step_masks(late, batch, frozenset({EOS_ID})) == []
    assert allowed(late.host[0]) == {"</s>"} and not late.states[0].is_stuck
    # a step whose every row has ended runs no batch fill, and says so
    ended = FillJob(
        late.host[:1], [0], late.states[:1], late.token_lists[:1], late.num_prompt_tokens[:1],
        late.num_output_tokens[:1], lambda: [JSON_VOCAB["{"]],
    )  # fmt: skip
    times = FillTimes()
    assert fill_step_masks(ended, batch, frozenset({EOS_ID}), times) == []
    assert (times.bitmask_rows, times.bitmask_seconds) == (0, 0.0)


def test_the_grammar_waits_for_the_sampled_token_and_the_loop_does_not(tmp_path: Path) -> None:
    """`start` returns at once; the fill waits for the newest ids (as it waits for the step that
    sampled them on a device) and masks with them, not with the placeholder in the list."""
    grammar = grammar_for(tmp_path)
    sampled = threading.Event()

    class LateHistory:
        def __init__(self) -> None:
            self.seqs = [Seq([*PROMPT, *ids("{"), PLACEHOLDER_TOKEN_ID]), Seq([*PROMPT])]

        def newest_token_list(self) -> list[int]:
            assert sampled.wait(30), "the test never released the newest ids"
            return [JSON_VOCAB['"'], PROMPT[-1]]

    params = [SamplingParams(json_schema=SCHEMA), SamplingParams()]
    masks = grammar.start(params, LateHistory())
    assert not masks.filled.done(), "the fill waits for the newest ids on the grammar thread"
    sampled.set()
    scores = torch.zeros(2, V)
    assert grammar.apply(scores, masks) == []
    assert {TOKENS[t] for t in torch.nonzero(scores[0].isfinite()).flatten().tolist()} == {"o"}
    assert bool(scores[1].isfinite().all()), "a free row is not masked"


def generate(
    path: Path, async_scheduling: bool, requests: dict[str, SamplingParams], device: str = "cpu"
) -> dict[str, list[EngineOutput]]:
    runner = make_runner(path, num_blocks=64, max_model_len=128, device=device)
    config = EngineConfig(
        model=str(path), device=device, block_size=8, max_model_len=128, max_num_seqs=4,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = LLMEngine(config, runner, frozenset({EOS_ID}), check_sampling=runner.check_sampling)
    assert engine.is_async is async_scheduling
    for rid, p in requests.items():
        engine.add_request(rid, [1, *ids(f"json {rid}:")], p)
    if async_scheduling:  # a structured step's sampling is deferred to the next launch
        engine.step()
        assert isinstance(engine._in_flight.pending, DeferredStep)  # type: ignore[union-attr]
    return run_all(engine)


@pytest.fixture(scope="module")
def json_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("json-llama")
    write_checkpoint(path, max_positions=128, vocab=JSON_VOCAB)
    return path


def check_deferred_sampling(path: Path, device: str) -> None:
    requests = {
        "a": SamplingParams(max_tokens=60, temperature=0.0, json_schema=SCHEMA),
        "b": SamplingParams(max_tokens=12, temperature=0.0),  # a free row beside them
        "c": SamplingParams(max_tokens=60, temperature=1.0, seed=3, json_schema=SCHEMA),
    }
    sync = generate(path, False, requests, device)
    overlapped = generate(path, True, requests, device)
    assert {r: tokens_of(o) for r, o in overlapped.items()} == {
        r: tokens_of(o) for r, o in sync.items()
    }
    for rid in ("a", "c"):
        out = tokens_of(sync[rid])
        assert out[-1] == EOS_ID and sync[rid][-1].finish_reason == "stop"
        value = json.loads("".join(TOKENS[t] for t in out[:-1]))
        assert set(value) == {"ok", "level"} and value["level"] in ("low", "high")


def test_deferred_sampling_gives_the_synchronous_tokens_and_matches(json_checkpoint: Path) -> None:
    check_deferred_sampling(json_checkpoint, "cpu")


def test_a_reply_the_vocabulary_cannot_finish_ends_as_cut(json_checkpoint: Path) -> None:
    """The vocabulary spells `{"` but no upper-case letter: the key "Q" can never be written."""
    schema = json.dumps({"type": "object", "properties": {"Q": {"type": "boolean"}},
                         "required": ["Q"], "additionalProperties": False})  # fmt: skip
    for async_scheduling in (False, True):
        outs = generate(
            json_checkpoint,
            async_scheduling,
            {"q": SamplingParams(max_tokens=30, temperature=0.0, json_schema=schema)},
        )["q"]
        assert tokens_of(outs) == [*ids('{"'), EOS_ID]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
