"""Structured output's timings: each step with a schema row is observed once in every histogram
of `GrammarTimings` (its parts summing to the fill), a step without one is not observed at
all, and the figures reach the loop's stats and cross the process boundary intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.stats import STEP_SECONDS_BUCKETS, GrammarTimings
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import StepOutputs, from_core_codec
from pagekeeper_engine.runner.grammar_timing import DurationHistogram, FillTimes, GrammarTimer
from pagekeeper_engine.runner.logits_processing import StepHistory
from tests.engine.checkpoints import make_runner
from tests.engine.cpu.test_structured_deferred import ids
from tests.engine.cpu.test_structured_output import PROMPT, SCHEMA, Seq, grammar_for
from tests.engine.fakes import run_all, tokens_of
from tests.engine.server.checkpoint import EOS_ID, JSON_VOCAB, write_checkpoint

NAMES = (
    "queue", "fill", "fill_device_wait", "fill_accept", "fill_bitmask", "fill_host_ops", "wait",
    "apply",
)  # fmt: skip


def num_observed(timings: GrammarTimings) -> dict[str, int]:
    return {name: getattr(timings, name).num_observed for name in NAMES}


def test_a_duration_falls_in_the_first_bucket_whose_bound_holds_it() -> None:
    histogram = DurationHistogram()
    for seconds in (0.0, 0.0001, 0.00010001, 0.0012, 0.05, 0.0500001, 3.0):
        histogram.observe(seconds)
    counts = histogram.snapshot().counts
    assert len(counts) == len(STEP_SECONDS_BUCKETS) + 1
    bucket_of = {STEP_SECONDS_BUCKETS[i] if i < len(counts) - 1 else "+Inf": c
                 for i, c in enumerate(counts) if c}  # fmt: skip
    assert bucket_of == {0.0001: 2, 0.00025: 1, 0.0015: 1, 0.05: 1, "+Inf": 2}
    assert histogram.snapshot().sum_seconds == pytest.approx(3.10140011)


def test_a_steps_marks_become_its_durations() -> None:
    timer = GrammarTimer()
    marks = FillTimes(submitted=10.0, started=10.0002, ids_on_host=10.0007, accepted=10.0009,
                      bitmask_seconds=0.0012, ended=10.0025)  # fmt: skip
    timer.observe(marks, wait_seconds=0.004, apply_seconds=0.00003)
    timings = timer.snapshot()
    sums = {name: getattr(timings, name).sum_seconds for name in NAMES}
    assert sums == pytest.approx({
        "queue": 0.0002, "fill": 0.0023, "fill_device_wait": 0.0005, "fill_accept": 0.0002,
        "fill_bitmask": 0.0012, "fill_host_ops": 0.0004, "wait": 0.004, "apply": 0.00003,
    })  # fmt: skip
    assert set(num_observed(timings).values()) == {1}
    parts = marks.parts()  # what the benchmarks read: the same durations
    assert (parts.queue, parts.fill, parts.device_wait) == pytest.approx((0.0002, 0.0023, 0.0005))
    assert (parts.accept, parts.bitmask, parts.host_ops) == pytest.approx((0.0002, 0.0012, 0.0004))


def test_every_histogram_observes_each_structured_step_once(tmp_path: Path) -> None:
    grammar = grammar_for(tmp_path)
    assert set(num_observed(grammar.timings()).values()) == {0}
    params = [SamplingParams(json_schema=SCHEMA), SamplingParams()]
    history = StepHistory([Seq(PROMPT), Seq(PROMPT)], torch.tensor([6, 6]), torch.arange(2))
    for _ in range(3):
        grammar.mask_now(torch.zeros(2, len(JSON_VOCAB)), params, history)
    timings = grammar.timings()
    assert set(num_observed(timings).values()) == {3}
    parts = ("fill_device_wait", "fill_accept", "fill_bitmask", "fill_host_ops")
    assert sum(getattr(timings, p).sum_seconds for p in parts) == pytest.approx(
        timings.fill.sum_seconds, rel=1e-9
    )
    assert timings.fill_bitmask.sum_seconds > 0.0, "the batch fill was timed"


@pytest.fixture(scope="module")
def json_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("json-llama")
    write_checkpoint(path, max_positions=128, vocab=JSON_VOCAB)
    return path


def serve(
    path: Path, requests: dict[str, SamplingParams], async_scheduling: bool = False
) -> tuple[LLMEngine, list[int]]:
    """An engine on the CPU run to the end: it, and each request's token count."""
    runner = make_runner(path, num_blocks=64, max_model_len=128)
    config = EngineConfig(model=str(path), device="cpu", block_size=8, max_model_len=128,
                          max_num_seqs=4, async_scheduling=async_scheduling)  # fmt: skip
    engine = LLMEngine(config, runner, frozenset({EOS_ID}), check_sampling=runner.check_sampling)
    for rid, p in requests.items():
        engine.add_request(rid, [1, *ids(f"json {rid}:")], p)
    outputs = run_all(engine)
    return engine, [len(tokens_of(outputs[rid])) for rid in requests]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_schema_requests_steps_reach_the_loops_stats(
    json_checkpoint: Path, async_scheduling: bool
) -> None:
    """One step a token for the structured request (the plain one beside it adds none), and
    with asynchronous scheduling the step launched before its stop was seen; in the stats the
    core sends its front ends, through the codec."""
    engine, (num_tokens, _) = serve(
        json_checkpoint,
        {
            "a": SamplingParams(max_tokens=40, temperature=0.0, json_schema=SCHEMA),
            "b": SamplingParams(max_tokens=50, temperature=0.0),
        },
        async_scheduling,
    )
    stats = engine.stats()
    assert num_tokens < 40, "the schema ended the reply"
    assert set(num_observed(stats.grammar).values()) == {num_tokens + int(async_scheduling)}
    codec = from_core_codec()
    decoded = codec.decode(codec.encode(StepOutputs([], stats)))
    assert decoded.stats.grammar == stats.grammar


def test_requests_without_a_schema_are_not_timed(json_checkpoint: Path) -> None:
    engine, _ = serve(json_checkpoint, {"b": SamplingParams(max_tokens=8, temperature=0.0)})
    assert engine.stats().grammar == GrammarTimings()
