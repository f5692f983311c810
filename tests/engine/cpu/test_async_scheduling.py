"""Asynchronous scheduling (step N+1 booked while step N runs) gives what the synchronous loop
gives: the same outputs token for token and chunk for chunk, the same stops, and the same KV
block accounting once every request has ended. Driven by the paged fake runner (which reads its
KV cache back) and by the real model runner on the CPU."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.kv_manager import num_blocks_for
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import SequenceStatus
from pagekeeper_engine.frontend.detokenizer import TextState, detokenize_next
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import EngineOutput
from tests.engine.checkpoints import make_runner, tokens, write_checkpoint
from tests.engine.fakes import (
    EOS,
    IdTokenizer,
    PagedFakeRunner,
    make_engine,
    rollout,
    run_all,
    tokens_of,
)

PROMPTS = {
    "p0": [3, 1, 4],
    "p1": [*range(1, 13), 5, 9],
    "p2": list(range(20, 37)),
    "p3": [7] * 5,
    "p4": [*range(1, 9), 2, 6, 5, 3, 5, 8, 9, 7, 9],
}


def params_for(request_id: str) -> SamplingParams:
    """Every stop condition of the core: lengths, stop tokens, min_tokens (stop strings are the
    front end's)."""
    prompt = PROMPTS[request_id]
    out = rollout(prompt, 20)
    if request_id == "p0":
        return SamplingParams(max_tokens=7, temperature=0.0, logprobs=True)
    if request_id == "p1":  # stops on its 6th token
        return SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(out[5],))
    if request_id == "p2":  # stops on its 5th token
        return SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(out[4],))
    if request_id == "p3":  # its 3rd token would stop it but min_tokens defers to the 12th
        return SamplingParams(
            max_tokens=20, temperature=0.0, stop_token_ids=(out[2], out[11]), min_tokens=9
        )
    return SamplingParams(max_tokens=13, temperature=0.0)


def run(async_scheduling: bool, **engine_args: Any) -> tuple[LLMEngine, PagedFakeRunner, Any]:
    engine, runner = make_engine(async_scheduling=async_scheduling, **engine_args)
    assert engine.is_async is async_scheduling
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params_for(rid))
    return engine, runner, run_all(engine)


def chunks(outputs: dict[str, list[EngineOutput]]) -> dict[str, list[tuple[Any, ...]]]:
    """Each output as (tokens, finished, reason, logprobs, counts, error, alternatives), per
    request."""
    return {
        rid: [
            (
                o.new_token_ids,
                o.finished,
                o.finish_reason,
                o.logprobs,
                o.num_output_tokens,
                o.num_prompt_tokens,
                o.error,
                o.top_logprobs,
            )
            for o in outs
        ]
        for rid, outs in outputs.items()
    }


SCENARIOS = [
    ("roomy", {"num_gpu_blocks": 256, "budget": 64}),
    ("roomy-no-prefix-cache", {"num_gpu_blocks": 256, "budget": 64, "prefix": False}),
    ("small-chunks", {"num_gpu_blocks": 256, "budget": 8}),
    ("no-chunked-prefill", {"num_gpu_blocks": 256, "budget": 32, "chunked": False}),
    ("recompute", {"num_gpu_blocks": 14, "budget": 16}),
    ("swap", {"num_gpu_blocks": 14, "num_cpu_blocks": 64, "budget": 16, "min_swap_tokens": 4}),
]


@pytest.mark.parametrize(("name", "engine_args"), SCENARIOS)
def test_async_outputs_and_stops_equal_sync(name: str, engine_args: dict[str, Any]) -> None:
    sync_engine, _, sync_out = run(False, **engine_args)
    async_engine, runner, async_out = run(True, **engine_args)
    assert runner.num_placeholders > 0  # decodes really took their input from the device side
    assert chunks(async_out) == chunks(sync_out)
    reasons = {rid: outs[-1].finish_reason for rid, outs in sync_out.items()}
    assert reasons == {"p0": "length", "p1": "stop", "p2": "stop", "p3": "stop", "p4": "length"}
    assert len(tokens_of(sync_out["p1"])) == 6 and len(tokens_of(sync_out["p3"])) == 12
    s, a = sync_engine.stats(), async_engine.stats()
    assert (a.num_used_blocks, a.num_running, a.num_waiting, a.num_swapped) == (0, 0, 0, 0)
    for key in ("num_generation_tokens", "num_prompt_tokens", "num_requests_success"):
        assert getattr(a, key) == getattr(s, key), key
    if name.startswith(("roomy", "small", "no-chunked")):  # no preemption: the same decisions
        assert (a.num_free_blocks, a.num_cached_blocks, a.num_cache_only_blocks) == (
            s.num_free_blocks,
            s.num_cached_blocks,
            s.num_cache_only_blocks,
        )
        assert (a.prefix_cache_queries, a.prefix_cache_hits) == (
            s.prefix_cache_queries,
            s.prefix_cache_hits,
        )
        # the only extra work: one speculative token for each of the three stop-ended requests
        assert a.num_batched_tokens_total == s.num_batched_tokens_total + 3


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_loop_counts_its_waits_for_the_device(async_scheduling: bool) -> None:
    """Each settled step adds what the clock advanced across its `result()`; here the clock
    ticks one second a read, so the count is one second a launched step (each is settled once),
    and the synchronous loop, which settles nothing, counts none."""
    ticks = itertools.count()
    engine, _, _ = run(async_scheduling, clock=lambda: float(next(ticks)))
    expected = float(engine.num_steps) if async_scheduling else 0.0
    assert engine.num_steps > 0
    assert engine.device_wait_seconds == expected
    assert engine.stats().device_wait_seconds == expected


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_loop_times_each_part_of_its_steps(async_scheduling: bool) -> None:
    """With a clock that ticks one second a read, each part of a step counts one second each
    time the loop takes it: scheduling at every `step()` call, launching, booking, waiting and
    applying once a launched step (the synchronous loop's launch is its whole `execute`, and it
    books and waits for nothing)."""
    ticks = itertools.count()
    engine, _ = make_engine(async_scheduling=async_scheduling, clock=lambda: float(next(ticks)))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params_for(rid))
    num_calls = 0
    while engine.has_work():
        engine.step()
        num_calls += 1
    steps = float(engine.num_steps)
    assert steps > 0
    spent = engine.host_seconds
    booked = steps if async_scheduling else 0.0
    assert spent.as_dict() == {
        "schedule": float(num_calls),
        "launch": steps,
        "book": booked,
        "wait": booked,
        "apply": steps,
    }
    assert spent.since(spent.copy()).as_dict() == dict.fromkeys(spent.as_dict(), 0.0)


def test_block_tables_stay_exact_while_steps_overlap() -> None:
    """Between steps every running sequence holds exactly the blocks its booked tokens need,
    and the pool's used count is the sum of them (no prefix sharing here)."""
    engine, _ = make_engine(async_scheduling=True, num_gpu_blocks=64, budget=16, prefix=False)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params_for(rid))
    num_overlapped = 0
    while engine.has_work():
        engine.step()
        sched = engine.scheduler
        for seq in sched.running:
            assert seq.num_pending_tokens <= 1  # only the step in flight is unknown
            num_overlapped += seq.num_pending_tokens
            assert len(seq.block_ids) == num_blocks_for(seq.num_tokens - 1, 4) or (
                seq.num_computed_tokens < seq.num_prompt_tokens  # a prompt reserves all its blocks
            )
        assert sched.kv.pool.num_used_blocks == sum(len(s.block_ids) for s in sched.running)
    assert num_overlapped > 0
    assert engine.scheduler.kv.pool.num_used_blocks == 0


def test_length_limited_sequences_get_no_speculative_step() -> None:
    engine, runner = make_engine(async_scheduling=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
    outputs = run_all(engine)
    assert tokens_of(outputs["a"]) == rollout([1, 2, 3], 5)
    # one prefill step of 3 tokens and four decodes: nothing beyond the fifth token
    assert runner.num_batched_tokens == [3, 1, 1, 1, 1]


def test_abort_while_a_step_is_in_flight_frees_everything() -> None:
    engine, _ = make_engine(async_scheduling=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    seen: list[EngineOutput] = []
    for _ in range(4):
        seen += engine.step()
    seq = engine.scheduler.requests["a"]
    assert seq.num_pending_tokens == 1
    assert engine.abort("a")
    assert seq.token_ids.count(-1) == 0 and seq.status is SequenceStatus.FINISHED_ABORTED
    rest = run_all(engine)
    aborted = [o for o in rest.get("a", []) if o.finished]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert tokens_of([o for o in seen + rest["b"] if o.request_id == "b"]) == rollout([4, 5, 6], 4)
    assert engine.stats().num_used_blocks == 0


def test_out_of_memory_in_an_overlapped_step_is_recovered_with_the_same_tokens() -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = {rid: rollout(p, 12) for rid, p in PROMPTS.items()}
    engine, runner = make_engine(async_scheduling=True, budget=32)
    runner.oom_at_steps = {3, 4}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, greedy)
    outputs = run_all(engine)
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == expected
    stats = engine.stats()
    assert stats.num_oom_events["step"] == 2 and stats.num_used_blocks == 0


def test_a_failed_overlapped_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine, runner = make_engine(async_scheduling=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    engine.step()
    runner.fail_next = True
    failed = engine.step()
    assert [(o.request_id, o.finish_reason) for o in failed][-1] == ("a", "abort")
    assert failed[-1].error is not None and "device fell over" in failed[-1].error
    assert engine.stats().num_used_blocks == 0
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    assert tokens_of(run_all(engine)["b"]) == rollout([4, 5], 3)


def test_eos_ends_an_overlapped_request() -> None:
    script = {"a": [5, 6, EOS, 7, 8]}
    engine, _ = make_engine(async_scheduling=True, script=script)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=5, temperature=0.0))
    outs = run_all(engine)["a"]
    assert tokens_of(outs) == [5, 6, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == 3


# -- the real model runner on the CPU --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(path, "qwen3")
    return path


def generate(checkpoint: Path, async_scheduling: bool, params: dict[str, SamplingParams]) -> Any:
    runner = make_runner(checkpoint, num_blocks=40)
    config = EngineConfig(
        model="tiny",
        device="cpu",
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config, runner, IdTokenizer().eos_token_ids)
    assert engine.is_async is async_scheduling
    for rid, p in params.items():
        engine.add_request(rid, tokens(7 + 3 * int(rid[1:]), offset=11 * int(rid[1:]) + 1), p)
    outputs = run_all(engine)
    stats = engine.stats()
    return chunks(outputs), (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks)


def test_real_runner_async_greedy_equals_sync(checkpoint: Path) -> None:
    greedy = {
        f"r{i}": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) for i in range(4)
    }
    sync_chunks, sync_blocks = generate(checkpoint, False, greedy)
    # the same runs, now each stopping on the token it produced fourth (or earlier repeats)
    stops = {
        rid: SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(outs[3][0][0],)
        )
        for rid, outs in sync_chunks.items()
    }
    assert generate(checkpoint, True, greedy) == (sync_chunks, sync_blocks)
    sync_stopped = generate(checkpoint, False, stops)
    assert generate(checkpoint, True, stops) == sync_stopped
    assert all(outs[-1][2] == "stop" for outs in sync_stopped[0].values())


def test_real_runner_seeded_sampling_is_unchanged_by_overlap(checkpoint: Path) -> None:
    seeded = {
        f"r{i}": SamplingParams(
            max_tokens=8, temperature=0.8, top_k=20, seed=7 + i, ignore_eos=True
        )
        for i in range(3)
    }
    assert generate(checkpoint, True, seeded) == generate(checkpoint, False, seeded)


def test_real_runner_processors_are_unchanged_by_overlap(checkpoint: Path) -> None:
    """The penalties read each row's newest token from the device while it is still a
    placeholder on the host: the overlapped loop gives the synchronous loop's tokens."""
    processed = {
        "r0": SamplingParams(
            max_tokens=9, temperature=0.0, ignore_eos=True, repetition_penalty=1.9
        ),
        "r1": SamplingParams(
            max_tokens=9,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=1.2,
            frequency_penalty=0.8,
            logit_bias=((5, 1.5),),
            logprobs=True,
            top_logprobs=3,
        ),
        "r2": SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        "r3": SamplingParams(max_tokens=9, temperature=0.9, seed=3, min_p=0.2, ignore_eos=True),
    }
    sync = generate(checkpoint, False, processed)
    assert generate(checkpoint, True, processed) == sync
    plain = generate(
        checkpoint,
        False,
        {rid: SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True) for rid in processed},
    )
    assert sync[0]["r0"] != plain[0]["r0"] and sync[0]["r1"] != plain[0]["r1"]
    assert sync[0]["r2"] == plain[0]["r2"], "a plain row beside processed ones is unchanged"
    assert all(len(o[7]) == 1 and len(o[7][0]) == 3 for o in sync[0]["r1"])


# -- the batched detokenizer -----------------------------------------------------------------

TEXT = ["héllo wörld ñandú 日本語のテキスト 😀🎉 ok", "the quick brown fox jumps\n over 12345"] * 20


def byte_level_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def per_token_reference(tok: HFTokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """The loop's previous detokenizer: two decode calls per token."""
    ids = list(prompt)
    prefix_offset, read_offset = max(0, len(ids) - 5), len(ids)
    pieces = []
    for token in output:
        ids.append(token)
        prefix_text = tok.decode(ids[prefix_offset:read_offset])
        full_text = tok.decode(ids[prefix_offset:])
        piece = ""
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            piece = full_text[len(prefix_text) :]
            prefix_offset, read_offset = read_offset, len(ids)
        pieces.append(piece)
    return pieces


def test_batched_detokenizer_gives_the_per_token_text_exactly() -> None:
    tok = byte_level_tokenizer()
    vocab = tok.get_vocab_size()
    params = SamplingParams(max_tokens=40)
    states, outputs = [], []
    for i in range(12):
        # real text, and (from the 7th on) arbitrary ids that split multi-byte characters
        prompt = tok.encode(TEXT[i % 2][i : i + 9]).ids
        text_ids = tok.encode("".join(TEXT[:4])[3 * i :]).ids[:25]
        noise = [(37 * i + 11 * k) % vocab for k in range(25)]
        outputs.append(text_ids if i < 6 else noise)
        states.append(TextState.for_prompt(prompt, params))
    calls = []

    def decode_batch(windows: list[list[int]]) -> list[str]:
        calls.append(len(windows))
        return [str(t) for t in tok.decode_batch(windows, skip_special_tokens=True)]

    prompts = [tok.encode(TEXT[i % 2][i : i + 9]).ids for i in range(12)]
    pieces: list[list[str]] = [[] for _ in states]
    for k in range(25):
        for state, out in zip(states, outputs, strict=True):
            state.append([out[k]])
        old = detokenize_next(decode_batch, states)
        for i, state in enumerate(states):
            pieces[i].append(state.output_text[old[i] :])
    assert calls == [24] * 25  # one call per step, two windows per request
    for i in range(len(states)):
        assert pieces[i] == per_token_reference(tok, prompts[i], outputs[i]), i
    assert states[0].output_text == tok.decode(outputs[0])
