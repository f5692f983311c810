"""W-chat's pure parts: the seeded requests, the client shares, the record of a stream, the
percentiles and the summary, the /metrics reading and the decode-step selection."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving_report import (
    StepSample,
    compare,
    decode_step_time,
    format_offline,
    format_online,
    format_table,
    memory_metrics,
    percentile,
    summarize,
)
from benchmarks.serving_workload import (
    PREFIX_LEN,
    ChatWorkload,
    EngineSettings,
    Level,
    RequestRecord,
    client_plans,
    completion_body,
    level_workloads,
    poisson_arrivals,
    token_id_range,
    w_chat,
)
from pagekeeper_engine.config import parse_args
from pagekeeper_engine.frontend.tokenizer import Tokenizer

LENGTHS: dict[str, Any] = {"vocab_size": 4000, "prompt_lens": (64, 80), "output_lens": (32, 40)}


def test_w_chat_draws_what_random_seed_draws() -> None:
    random.seed(7)
    prompts = []
    for _ in range(3):
        num_tokens = random.randint(64, 80)
        prompts.append([random.randrange(100, 3000) for _ in range(num_tokens)])
    output_lens = [random.randint(32, 40) for _ in range(3)]

    work = w_chat(3, 7, **LENGTHS)

    assert work.prompts == prompts
    assert work.output_lens == output_lens


def test_w_chat_stays_in_its_ranges_and_differs_by_seed() -> None:
    work = w_chat(64, "0/requests-c32", **LENGTHS)
    assert all(64 <= len(p) <= 80 for p in work.prompts)
    assert all(100 <= t < 3000 for p in work.prompts for t in p)
    assert all(32 <= n <= 40 for n in work.output_lens)
    assert w_chat(64, "0/requests-c32", **LENGTHS) == work
    assert w_chat(64, "0/requests-c128", **LENGTHS).prompts[0] != work.prompts[0]


def test_prefix_sharing_groups_of_16_share_1024_tokens() -> None:
    work = w_chat(20, 0, prefix_sharing=True, **LENGTHS)
    prefixes = [p[:PREFIX_LEN] for p in work.prompts]
    assert all(prefix == prefixes[0] for prefix in prefixes[:16])
    assert all(prefix == prefixes[16] for prefix in prefixes[16:])
    assert prefixes[0] != prefixes[16]
    assert all(64 <= len(p) - PREFIX_LEN <= 80 for p in work.prompts)
    assert len({tuple(p[PREFIX_LEN:]) for p in work.prompts}) == 20


def test_token_ids_keep_clear_of_special_tokens_where_the_vocabulary_allows() -> None:
    assert token_id_range(151936) == (100, 150936)
    assert token_id_range(46) == (0, 46)


def test_each_level_draws_its_own_requests_and_warm_up() -> None:
    closed, rate = Level(concurrency=32), Level(rate=2.5)
    work, warm = level_workloads(closed, 0, None, **LENGTHS)
    assert (len(work.prompts), len(warm.prompts)) == (128, 32)
    assert not set(map(tuple, warm.prompts)) & set(map(tuple, work.prompts))
    assert set(warm.output_lens) == {16}
    rate_work, rate_warm = level_workloads(rate, 0, None, **LENGTHS)
    assert (len(rate_work.prompts), len(rate_warm.prompts)) == (512, 16)
    assert rate_work.prompts[0] != work.prompts[0]
    assert len(level_workloads(closed, 0, 10, **LENGTHS)[0].prompts) == 10
    assert (closed.label, rate.label) == ("c32", "r2.5")
    whole = Level(concurrency=32, stream=False)
    assert whole.label == "c32-whole"
    whole_work, _ = level_workloads(whole, 0, None, **LENGTHS)
    # the twin's work, each first token moved so no block hits the prefix cache the twin filled
    assert whole_work.output_lens == work.output_lens
    assert [p[1:] for p in whole_work.prompts] == [p[1:] for p in work.prompts]
    assert all(a[0] != b[0] for a, b in zip(whole_work.prompts, work.prompts, strict=True))
    lo, hi = token_id_range(LENGTHS["vocab_size"])
    assert all(lo <= p[0] < hi for p in whole_work.prompts)
    plans = client_plans(
        whole, (whole_work, warm), 0, num_processes=2, url="u", model="m", timeout_s=1.0
    )
    assert [p.stream for p in plans] == [False, False]


def test_poisson_arrivals_accumulate_seeded_exponential_gaps() -> None:
    rng = random.Random("s")
    expected = list(itertools.accumulate(rng.expovariate(4.0) for _ in range(5)))
    assert poisson_arrivals(5, 4.0, "s") == expected
    assert expected == sorted(expected)


def test_closed_loop_splits_the_streams_and_open_loop_the_arrivals() -> None:
    requests = level_workloads(Level(concurrency=10), 0, 12, **LENGTHS)
    common = {"url": "u", "model": "m", "timeout_s": 1.0}
    plans = client_plans(Level(concurrency=10), requests, 0, num_processes=4, **common)
    assert [p.num_streams for p in plans] == [3, 3, 2, 2]
    assert sum(len(p.warmup) for p in plans) == 10
    assert plans[1].warmup[0] == (requests[1].prompts[1], 16)
    assert all(p.prompts == requests[0].prompts and not p.arrivals for p in plans)
    assert len(client_plans(Level(concurrency=2), requests, 0, num_processes=4, **common)) == 2

    requests = level_workloads(Level(rate=3.0), 0, 10, **LENGTHS)
    plans = client_plans(Level(rate=3.0), requests, 0, num_processes=4, **common)
    assert [p.num_streams for p in plans] == [0, 0, 0, 0]
    assert [i for i, _ in plans[1].arrivals] == [1, 5, 9]
    assert sorted(i for p in plans for i, _ in p.arrivals) == list(range(10))


def test_server_flags_parse_into_the_config_fields_of_the_same_names() -> None:
    for caching, eager, batched in [(True, False, None), (False, True, 4096)]:
        settings = EngineSettings("cpu", "float32", 4096, 128, 16, batched, 0.8, caching, eager)
        config = parse_args(["model", *settings.server_flags()])
        assert {k: getattr(config, k) for k in asdict(settings)} == asdict(settings)


def event(text: str | None = None, usage: dict[str, object] | None = None) -> str:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return json.dumps({"object": "text_completion", "choices": choices, "usage": usage})


USAGE = {
    "prompt_tokens": 70,
    "completion_tokens": 4,
    "prompt_tokens_details": {"cached_tokens": 16},
}


def streamed(chunks: list[tuple[float, str]], send_s: float = 0.0) -> RequestRecord:
    record = RequestRecord(0, 4, send_s=send_s, status=200)
    for at, text in chunks:
        record.on_event(event(text), at)
    record.on_event(event(usage=USAGE), chunks[-1][0])
    record.on_event("[DONE]", chunks[-1][0])
    record.end_s = chunks[-1][0]
    return record


def test_a_stream_records_chunks_usage_and_gaps_per_token() -> None:
    record = streamed([(1.0, "t5"), (1.5, ""), (2.0, " t7 t9"), (2.5, " t3")])
    assert record.chunk_s == [1.0, 2.0, 2.5]
    assert record.chunk_words == [1, 2, 1]
    assert (record.num_prompt_tokens, record.num_cached_tokens) == (70, 16)
    assert record.num_output_tokens == 4
    assert record.failure is None
    assert record.ttft_s == 1.0
    assert record.has_token_counts
    assert record.inter_token_gaps() == [0.5, 0.5, 0.5]


def test_chunks_that_cannot_be_counted_give_one_gap_each() -> None:
    record = streamed([(1.0, "ab"), (2.0, "cd"), (2.5, "e")])  # 3 words, 4 tokens
    assert not record.has_token_counts
    assert record.inter_token_gaps() == [1.0, 0.5]


def test_failures_are_named_by_kind() -> None:
    mid_stream = RequestRecord(0, 4, send_s=0.0, status=200)
    mid_stream.on_event(json.dumps({"error": {"message": "boom", "code": "engine_error"}}), 1.0)
    no_usage = RequestRecord(0, 4, send_s=0.0, status=200)
    no_usage.on_event(event("t1"), 1.0)
    assert mid_stream.failure == "error mid-stream"
    assert json.loads(mid_stream.error or "")["message"] == "boom"
    assert no_usage.failure == "no usage chunk"
    assert RequestRecord(0, 4, send_s=0.0, status=429).failure == "HTTP 429"
    assert RequestRecord(0, 4, send_s=0.0).failure == "no response"


def test_percentile_interpolates_between_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 99) == 7.0


METRICS = """\
# HELP pagekeeper_allocator_reserved_bytes reserved
# TYPE pagekeeper_allocator_reserved_bytes gauge
pagekeeper_allocator_reserved_bytes{model_name="bench"} 3000.0
# HELP pagekeeper_allocator_allocated_bytes allocated
# TYPE pagekeeper_allocator_allocated_bytes gauge
pagekeeper_allocator_allocated_bytes{model_name="bench"} 1000.0
# HELP pagekeeper_allocator_fragmentation_bytes fragmentation
# TYPE pagekeeper_allocator_fragmentation_bytes gauge
pagekeeper_allocator_fragmentation_bytes{model_name="bench"} 2000.0
# HELP pagekeeper_memory_budget_bytes budget
# TYPE pagekeeper_memory_budget_bytes gauge
pagekeeper_memory_budget_bytes{model_name="bench",term="kv_cache"} 9.0
pagekeeper_memory_budget_bytes{model_name="bench",term="fragmentation_buffer"} 512.0
# HELP vllm:num_preemptions_total preemptions
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="bench"} 3.0
"""


def test_summary_rates_latencies_and_failures() -> None:
    fast = streamed([(1.0, "t1"), (1.5, " t2"), (2.0, " t3"), (2.5, " t4")])
    slow = streamed([(3.0, "t1 t2"), (4.0, " t3 t4")], send_s=1.0)
    rejected = RequestRecord(2, 4, send_s=0.5, end_s=0.75, status=429, error='{"error": "full"}')
    again = RequestRecord(3, 4, send_s=0.5, end_s=0.75, status=429, error="second")
    lost = RequestRecord(4, 4, send_s=0.5, end_s=5.0, error="ClientOSError: reset")

    summary = summarize([fast, slow, rejected, again, lost])

    assert (summary["num_requests"], summary["num_ok"]) == (5, 2)
    assert summary["wall_s"] == 5.0
    assert summary["num_output_tokens"] == 8
    assert summary["output_tok_s"] == 8 / 5.0
    assert summary["total_tok_s"] == (8 + 140) / 5.0
    assert summary["num_cached_tokens"] == 32
    assert summary["ttft_ms"]["p50"] == 1500.0
    assert summary["itl_ms"]["p50"] == 500.0  # 3 gaps of 0.5 s, 2 of 0.5 s (1 s over 2 tokens)
    assert summary["e2e_ms"]["p50"] == 2750.0
    assert summary["num_itl_exact"] == 2
    assert summary["tokens_per_event"] == 8 / 6  # 8 tokens in 4 + 2 events
    assert summary["failures"] == {"HTTP 429": 2, "no response": 1}
    assert summary["first_errors"] == {
        "HTTP 429": '{"error": "full"}',
        "no response": "ClientOSError: reset",
    }
    row = {"level": "c2", "online": summary, "memory": memory_metrics(METRICS)}
    line = format_online(row)
    assert "2/5 ok in 5.0 s" in line
    assert "failures: 2 HTTP 429, 1 no response" in line
    assert "first HTTP 429: {" in line
    assert "1.33 tokens per SSE event" in line
    head, rule, body = format_table([row]).splitlines()
    assert head.count("|") == rule.count("|") == body.count("|") == 14
    assert body.startswith("| c2 | 2/5 | 2 | 30 | 0.40 | 1,500.0/1,900.0/1,990.0 | 500.0/")
    assert body.endswith("| 0.0 | - | - | - | - |")


def test_memory_metrics_read_the_allocator_and_the_budget_term() -> None:
    assert memory_metrics(METRICS) == {
        "reserved_bytes": 3000.0,
        "allocated_bytes": 1000.0,
        "reserved_minus_allocated_bytes": 2000.0,
        "fragmentation_bytes": 2000.0,
        "fragmentation_buffer_bytes": 512.0,
        "num_preemptions": 3.0,
    }
    cpu_page = METRICS[METRICS.index("# HELP vllm:") :]
    assert memory_metrics(cpu_page)["reserved_minus_allocated_bytes"] is None
    assert memory_metrics(cpu_page)["num_preemptions"] == 3.0


def test_decode_step_time_keeps_pure_decode_steps_at_the_batch() -> None:
    steps = [
        StepSample(0.100, 0, 900),  # prefill
        StepSample(0.050, 10, 10),  # after a prefill: its tokens may be this call's wait
        StepSample(0.010, 10, 10),
        StepSample(0.012, 9, 10),
        StepSample(0.030, 10, 74),  # a prefill chunk joined
        StepSample(0.020, 10, 10),  # after it
        StepSample(0.014, 10, 10),
        StepSample(0.001, 4, 4),  # the tail: too few requests left
    ]
    assert decode_step_time(steps, 10) == (0.012, 3)
    assert decode_step_time(steps[:2], 10) == (None, 0)


def test_compare_and_the_offline_line() -> None:
    online = {"output_tok_s": 850.0, "itl_ms": {"p50": 15.0}}
    offline = {
        "output_tok_s": 1000.0,
        "decode_step_ms": 10.0,
        "num_decode_steps_timed": 7,
        "seconds": 2.0,
        "num_finished": 8,
        "num_failed": 0,
    }
    ratios = compare(online, offline)
    assert ratios == {"online_over_offline": 0.85, "itl_p50_over_decode_step": 1.5}
    line = format_offline({"level": "c8", "offline": offline, **ratios})
    assert (
        "online / offline 85%; decode step 10.00 ms (7 steps); ITL p50 / decode step 1.50x" in line
    )


def test_text_prompts_are_the_words_the_word_tokenizer_maps_back(tmp_path: Path) -> None:
    from benchmarks.serving_server import write_word_tokenizer  # noqa: PLC0415

    write_word_tokenizer(tmp_path, 500)
    tokenizer = Tokenizer.from_dir(tmp_path)
    prompt = [5, 499, 0, 17, 17, 230]
    body = completion_body("bench", prompt, 9, as_text=True)
    assert body["prompt"] == "t5 t499 t0 t17 t17 t230"
    assert tokenizer.encode(body["prompt"]) == prompt
    assert completion_body("bench", prompt, 9)["prompt"] == prompt


def test_a_non_streaming_body_carries_usage_and_no_first_token_time() -> None:
    streaming = completion_body("bench", [1, 2], 4)
    assert streaming["stream"] is True
    assert streaming["stream_options"] == {"include_usage": True}
    whole = completion_body("bench", [1, 2], 4, stream=False)
    assert whole["stream"] is False and "stream_options" not in whole
    record = RequestRecord(0, 4, send_s=1.0, end_s=3.0, status=200)
    record.on_body(json.dumps({"choices": [{"text": "t1 t2 t3 t4"}], "usage": USAGE}))
    assert record.failure is None
    assert (record.num_output_tokens, record.num_cached_tokens) == (4, 16)
    assert record.ttft_s is None and record.inter_token_gaps() == []
    summary = summarize([record])
    assert summary["output_tok_s"] == 2.0
    assert summary["ttft_ms"]["p99"] is None and summary["e2e_ms"]["p50"] == 2000.0


def test_ttft_of_the_first_wave_and_after_it_are_given_apart() -> None:
    records = []
    for index, ttft in enumerate([0.1, 0.2, 3.0, 4.0]):  # the first two are the first wave
        record = streamed([(ttft, "t1"), (ttft + 0.5, " t2 t3 t4")])
        record.index = index
        records.append(record)
    summary = summarize(records, first_wave=2)
    assert summary["first_wave"] == 2
    assert summary["ttft_first_wave_ms"]["p50"] == pytest.approx(150.0)
    assert summary["ttft_after_first_wave_ms"]["p50"] == pytest.approx(3500.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(1600.0)
    line = format_online({"level": "c2", "online": summary, "memory": memory_metrics(METRICS)})
    assert "first wave of 2 150.0/190.0/199.0, after it 3,500.0/3,900.0/3,990.0" in line
    assert summarize(records)["ttft_first_wave_ms"]["p50"] is None


def test_the_first_wave_floor_is_its_prefill_flops_over_the_rate() -> None:
    from benchmarks.serving import first_wave_floor_ms  # noqa: PLC0415
    from benchmarks.shapes import SHAPES, prefill_flops  # noqa: PLC0415

    cfg = SHAPES["llama-3.1-8b"]
    work = ChatWorkload([[1] * 1000, [1] * 2000, [1] * 5000], [8, 8, 8])
    # 8B: 6.98e9 matmul parameters a token (the LM head runs once a prompt, not counted)
    per_token = 2 * (32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336))
    attention = (1000**2 + 2000**2) * 2 * 32 * 128 * 32
    assert prefill_flops(cfg, [1000, 2000]) == per_token * 3000 + attention
    assert first_wave_floor_ms(cfg, work, 2, 1e15) == pytest.approx(
        (per_token * 3000 + attention) / 1e15 * 1e3
    )
    # a tensor-parallel server splits the same FLOPs over its GPUs
    assert first_wave_floor_ms(cfg, work, 2, 1e15, num_gpus=4) == pytest.approx(
        (per_token * 3000 + attention) / 4e15 * 1e3
    )


def test_the_server_gpus_are_read_from_the_engine_args() -> None:
    from benchmarks.serving import server_num_gpus  # noqa: PLC0415

    assert server_num_gpus([]) == 1
    assert server_num_gpus(["--tensor-parallel-size", "4"]) == 4
    assert server_num_gpus(["--max-num-seqs=8", "--tensor-parallel-size=2"]) == 2


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    from benchmarks.serving_server import parse_cpus  # noqa: PLC0415

    assert parse_cpus("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpus(None) == set() == parse_cpus("")
