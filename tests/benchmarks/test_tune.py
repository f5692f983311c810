"""W-tune: the classes' requests, the window read from /metrics, and a smoke run on the CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks import tune, tune_serve
from benchmarks import tune_trial as tt
from benchmarks import tune_workload as tw
from benchmarks.serving_workload import RequestRecord
from harness.cpu_engine import write_tiny_checkpoint
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import SecondaryFigure
from pagekeeper_operator.tuning.window import MetricWindow

VOCAB = 4000


def metrics(**values: float) -> tw.Scrape:
    names = {
        "success": 'vllm:request_success_total{model_name="m",finished_reason="stop"}',
        "generated": 'vllm:generation_tokens_total{model_name="m"}',
        "prompt": 'vllm:prompt_tokens_total{model_name="m"}',
        "kv": 'vllm:kv_cache_usage_perc{model_name="m"}',
        "running": 'vllm:num_requests_running{model_name="m"}',
        "waiting": 'vllm:num_requests_waiting{model_name="m"}',
        "queries": 'vllm:prefix_cache_queries_total{model_name="m"}',
        "hits": 'vllm:prefix_cache_hits_total{model_name="m"}',
        "shadow": 'pagekeeper_prefix_cache_shadow_hits_total{model_name="m"}',
        "oom_step": 'pagekeeper_oom_events_total{model_name="m",kind="step"}',
        "total": 'pagekeeper_memory_budget_bytes{model_name="m",term="total",rank="0"}',
    }
    return tw.Scrape.parse("".join(f"{names[k]} {v}\n" for k, v in values.items()))


def test_the_window_is_counters_as_differences_and_gauges_over_the_round() -> None:
    before = metrics(success=10, generated=1000, prompt=500, queries=500, hits=100, shadow=0,
                     oom_step=1, kv=0.1, running=0, waiting=0)  # fmt: skip
    during = [metrics(kv=0.5, running=16, waiting=4), metrics(kv=0.9, running=8, waiting=0)]
    after = metrics(success=110, generated=21000, prompt=30500, queries=30500, hits=9100,
                    shadow=0, oom_step=1, kv=0.3, running=0, waiting=0, total=8e10)  # fmt: skip
    record = RequestRecord(0, 4, send_s=0.0, status=200)
    window = tw.window_of(before, after, during, [record], 10.0, max_num_seqs=16)
    assert isinstance(window, MetricWindow)
    assert (window.num_requests, window.output_tokens_per_s, window.prompt_tokens) == (
        100.0,
        2000.0,
        30000.0,
    )
    assert (window.prefix_queries, window.prefix_hits, window.prefix_shadow_hits) == (
        30000.0,
        9000.0,
        0.0,
    )
    assert window.kv_usage_peak == 0.9 and window.kv_usage_avg == 0.5666666666666667
    assert (window.running_peak, window.seq_cap_fraction, window.waiting_avg) == (
        16.0,
        1 / 3,
        4 / 3,
    )
    assert (window.num_oom_step, window.gpu_total_bytes, window.reserved_peak_bytes) == (
        0.0,
        8e10,
        None,
    )


def test_classes_follow_the_workload_description() -> None:
    chat, rag, burst, longout = tw.classes(0, VOCAB, 8192, quick=True)
    assert (chat.concurrency, len(chat.work.prompts), chat.start.max_num_seqs) == (128, 512, 16)
    assert all(64 <= len(p) <= 512 for p in chat.work.prompts)
    prefixes = {tuple(p[: tw.RAG_PREFIX_LEN]) for p in rag.work.prompts}
    assert len(prefixes) == tw.RAG_PREFIXES and len(rag.work.prompts) == 384
    assert all(32 <= len(p) - tw.RAG_PREFIX_LEN <= 4096 for p in rag.work.prompts)
    assert (rag.start.enable_prefix_caching, rag.start.block_size) == (False, 32)
    long_ones = [
        t for t, p in zip(burst.arrivals, burst.work.prompts, strict=True) if len(p) >= 3000
    ]
    assert sorted(set(long_ones)) == [0.0, 20.0] and len(long_ones) == 2 * tw.BURST_SIZE
    assert burst.arrivals == sorted(burst.arrivals)
    assert burst.start.gpu_memory_utilization == 0.1
    assert (burst.tuning.objective, burst.tuning.ttft_p99_seconds) == ("ThroughputUnderTTFT", 2.0)
    assert (chat.tuning.objective, rag.tuning.objective) == ("Throughput", "Throughput")
    # short prompts, long outputs, many streams under the default cap, a utilization far too low
    assert (longout.concurrency, len(longout.work.prompts)) == (tw.LONGOUT_STREAMS, 384)
    assert all(16 <= len(p) <= 64 for p in longout.work.prompts)
    assert all(256 <= n <= 768 for n in longout.work.output_lens)
    assert longout.start.max_num_seqs == 256
    assert longout.concurrency is not None and longout.concurrency < 256
    assert longout.start.gpu_memory_utilization == 0.1
    assert longout.tuning.objective == "Throughput"
    assert longout.tuning.secondaries == ("PreemptionsPer1000Requests", "TTFTP99", "ITLP99")
    for cls in (chat, rag, burst, longout):  # each grid point is served anew: not the start
        assert cls.start not in cls.grid and len(cls.grid) >= 2
    assert [c.name for c in tw.classes(0, VOCAB, 8192, quick=True)] == tune.parse_args([]).classes


def test_a_smoke_round_on_the_cpu(tmp_path: Path) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    report = tune.main([
        "--device", "cpu", "--model-dir", str(model_dir), "--classes", "chat", "--rounds", "2",
        "--scale", "0.05", "--num-requests", "12", "--no-grid", "--client-processes", "1",
        "--max-model-len", "512", "--sample-interval", "0.2", "--start-timeout", "180",
        "--fixtures", str(tmp_path / "fixtures"), "--metrics-dir", str(tmp_path / "metrics"),
    ])  # fmt: skip
    [chat] = report["classes"]
    [first] = chat["rounds"]  # 12 requests are too few for any rule: no change, no second round
    assert first["next"] is None and first["trial"]["verdict"] is None
    assert first["trial"]["failures"] == {} and first["trial"]["output_tok_s"] > 0
    assert first["in_force"]["maxNumSeqs"] == 16
    assert len(first["trial"]["figures"]["samples"]) == tt.SAMPLES
    # every secondary figure read (12 requests sent at once leave their span no first token)
    secondary = first["trial"]["figures"]["secondary"]
    assert set(secondary) == {"PreemptionsPer1000Requests", "TTFTP99", "ITLP99"}
    assert all(len(samples) <= tt.SAMPLES for samples in secondary.values())
    saved = MetricWindow.from_json((tmp_path / "fixtures" / "chat_round0.json").read_text())
    assert saved.num_requests == 12.0
    before, after = (
        tw.Scrape.parse((tmp_path / "metrics" / f"chat_round0.{when}.prom").read_text())
        for when in ("before", "after")
    )
    generated = "vllm:generation_tokens_total"
    assert (after.get(generated) or 0) - (before.get(generated) or 0) > 0


def test_a_burst_round_splits_its_arrivals_over_the_client_processes() -> None:
    burst = tw.classes(0, VOCAB, 8192, quick=True)[2]
    args = tune.parse_args(["--client-processes", "3"])
    plans = tune_serve.open_loop_plans("http://e", burst, args)
    assert [p.num_streams for p in plans] == [0, 0, 0]
    assert sorted(i for p in plans for i, _ in p.arrivals) == list(range(len(burst.arrivals)))
    assert all(p.warmup == [] and p.prompts is burst.work.prompts for p in plans)


def window_with(**numbers: float) -> MetricWindow:
    fields: dict[str, Any] = {"seconds": 60.0, "output_tokens_per_s": 1e3, **numbers}
    return MetricWindow(**fields)


def result(tok_s: float, ttft_ms: float, samples: list[float]) -> dict[str, Any]:
    return {
        "policy": {}, "output_tok_s": tok_s, "ttft_p99_ms": ttft_ms, "itl_p99_ms": 10.0,
        "preemptions": 0.0, "ooms": 0.0, "reserved_minus_allocated_peak_mib": 40.0,
        "failures": {}, "exit_code": 0,
        "figures": {"samples": samples, "ttft_p99_s": ttft_ms / 1e3, "itl_p99_s": 0.01},
    }  # fmt: skip


def test_rounds_keep_a_measured_win_roll_back_a_tie_and_hold_both_fields() -> None:
    """The loop as Apply mode runs it, over scripted rounds: the cap that binds is raised and
    kept (a win), caching off is tried and rolled back (a tie), and neither is tried again."""
    binding = window_with(num_requests=512.0, kv_usage_peak=0.05, seq_cap_fraction=0.9,
                          waiting_avg=100.0, running_peak=16.0, waiting_peak=112.0,
                          running_avg=16.0, prefix_queries=80_000.0, prefix_hits=0.0,
                          prompt_tokens=80_000.0)  # fmt: skip
    free = dataclasses.replace(binding, seq_cap_fraction=0.1, waiting_avg=0.0, waiting_peak=0.0)
    script = {
        "chat_round0": (result(900.0, 9000.0, [900.0 + i for i in range(16)]), binding),
        "chat_round1": (result(5000.0, 250.0, [5000.0 + i for i in range(16)]), free),
        "chat_round2": (result(4800.0, 240.0, [5005.0 + i for i in range(16)]), free),
        "chat_grid0": (result(3100.0, 4000.0, []), None),
        "chat_grid1": (result(5200.0, 240.0, []), None),
    }
    served: list[tuple[str, dict[str, Any]]] = []

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        served.append((tag, policy.to_api()))
        found, window = script[tag]
        return {**found, "policy": policy.to_api()}, window

    chat = tw.classes(0, VOCAB, 8192, quick=True)[0]
    chat = dataclasses.replace(chat, grid=chat.grid[:2])
    report = tune.run_class(chat, tune.parse_args(["--rounds", "5"]), serve)
    assert [tag for tag, _ in served] == [
        "chat_round0", "chat_round1", "chat_round2", "chat_grid0", "chat_grid1",
    ]  # fmt: skip
    first, second, third = report["rounds"]
    assert first["next"] == {"field": "maxNumSeqs", "current": "16", "proposed": "256",
                             "rule": "max-num-seqs-up"}  # fmt: skip
    assert second["trial"]["verdict"]["is_win"] and second["in_force"]["maxNumSeqs"] == 256
    assert second["trial"]["verdict"]["verdict"] == "Win"
    assert second["next"]["field"] == "enablePrefixCaching"
    assert third["trial"]["verdict"]["verdict"] == "Tie"
    assert third["trial"]["verdict"]["reason"] == "+0.1% tokens/s, under +3%; noise 0.1%"
    # The tie went back: the policy in force and its score are round 1's.
    assert third["in_force"] == second["in_force"] and third["in_force_score"] == 5000.0
    assert third["next"] is None  # both fields held, nothing else in the window
    assert (report["grid_best_tok_s"], report["round_reaching_90pct"]) == (5200.0, 1)
    assert report["rounds_more_than_5pct_worse"] == []
    assert report["trials_more_than_5pct_worse"] == [] and report["ooms"] == 0


def test_throughput_samples_interpolate_the_counter_over_equal_stretches() -> None:
    readings = [tt.Reading(0.0, 0.0), tt.Reading(1.0, 100.0), tt.Reading(3.0, 500.0)]
    assert tt.counter_at(readings, 2.0) == 300.0
    assert (tt.counter_at(readings, -1.0), tt.counter_at(readings, 9.0)) == (0.0, 500.0)
    assert tt.throughput_samples(readings, 0.0, 3.0, num=3) == [100.0, 200.0, 200.0]


def test_the_steady_span_ends_at_the_last_send_of_a_closed_loop() -> None:
    records = [RequestRecord(0, 4, send_s=1.0, end_s=5.0), RequestRecord(1, 4, send_s=3.0,
                                                                        end_s=9.0)]  # fmt: skip
    assert tt.steady_span(records, is_closed_loop=True) == (1.0, 3.0)
    assert tt.steady_span(records, is_closed_loop=False) == (1.0, 9.0)


def test_a_trial_is_judged_under_the_classes_objective() -> None:
    burst = tw.classes(0, VOCAB, 8192, quick=True)[2]
    same = [1000.0 + (i % 4) for i in range(16)]
    queued = tt.RoundFigures(same, ttft_p99_s=3.5, itl_p99_s=0.02)
    served = tt.RoundFigures(same, ttft_p99_s=1.1, itl_p99_s=0.02)
    verdict = tt.judge(served, queued, burst.tuning)
    assert verdict is not None and verdict.is_win  # the bound met, the same tokens served
    plain = tt.judge(served, queued, tw.classes(0, VOCAB, 8192, quick=True)[0].tuning)
    assert plain is not None and not plain.is_win  # under plain throughput alone: a tie


def test_a_latency_win_at_equal_throughput_is_judged_on_the_secondary_figures() -> None:
    """The long-output class's case: the same tokens/s, far fewer preemptions and a far lower
    TTFT p99 in every stretch wins under the throughput objective; the reverse loses."""
    same = [1000.0 + (i % 4) for i in range(16)]
    poor: dict[SecondaryFigure, list[float]] = {
        "PreemptionsPer1000Requests": [400.0 + i for i in range(16)],
        "TTFTP99": [8.0 + i / 10 for i in range(16)],
        "ITLP99": [0.02] * 16,
    }
    good: dict[SecondaryFigure, list[float]] = {"PreemptionsPer1000Requests": [0.0] * 16,
            "TTFTP99": [1.0 + i / 10 for i in range(16)], "ITLP99": [0.02] * 16}  # fmt: skip
    spec = tw.classes(0, VOCAB, 8192, quick=True)[3].tuning
    before, after = (tt.RoundFigures(same, None, None, figures) for figures in (poor, good))
    win = tt.judge(after, before, spec)
    assert win is not None and win.is_win, win
    assert win.reason.startswith("preemptions/1k requests -100% (p = ")
    assert win.evidence()["canaryPreemptionsPer1k"] == 0.0
    loss = tt.judge(before, after, spec)
    assert loss is not None and loss.verdict == "Loss", loss
    # A round that measured no secondary figure is judged on throughput alone: a tie.
    alone = tt.judge(tt.RoundFigures(same, None, None), before, spec)
    assert alone is not None and alone.verdict == "Tie"


def test_secondary_samples_per_stretch() -> None:
    """Preemptions per 1,000 finished requests from the counters, the p99 of the TTFTs and
    gaps that end in each stretch; a stretch with nothing to measure gives no sample."""
    finished = [tt.Reading(0.0, 0.0), tt.Reading(2.0, 20.0), tt.Reading(4.0, 20.0)]
    preempted = [tt.Reading(0.0, 0.0), tt.Reading(1.0, 5.0), tt.Reading(4.0, 5.0)]
    edges = tt.stretch_edges(0.0, 4.0, num=2)
    assert edges == [0.0, 2.0, 4.0]
    assert tt.preemption_samples(preempted, finished, edges) == [250.0]  # none finished after 2 s
    assert tt.p99_samples([(0.5, 1.0), (1.5, 3.0), (3.0, 2.0)], edges) == [2.98, 2.0]
    record = RequestRecord(0, 3, send_s=0.0, end_s=3.5, status=200, chunk_s=[0.5, 1.0, 3.0],
                           chunk_words=[1, 1, 1], num_output_tokens=3, has_usage=True)  # fmt: skip
    figures = tt.secondary_samples([record], preempted, finished, edges)
    assert figures == {"TTFTP99": [0.5], "ITLP99": [0.5, 2.0],
                       "PreemptionsPer1000Requests": [250.0]}  # fmt: skip
    assert "PreemptionsPer1000Requests" not in tt.secondary_samples([record], [], finished, edges)


def test_the_grid_can_come_first_and_reversed_and_reports_in_its_own_order() -> None:
    """`--grid-first --reverse-grid`: the grid's points are served before round 0, last to
    first, so no point is always served after the others; the report keeps the grid's order."""
    served: list[str] = []

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        served.append(tag)
        return {**result(float(policy.max_num_seqs), 0.0, []), "policy": policy.to_api()}, None

    chat = tw.classes(0, VOCAB, 8192, quick=True)[0]
    args = tune.parse_args(["--rounds", "1", "--grid-first", "--reverse-grid"])
    report = tune.run_class(chat, args, serve)
    assert served == ["chat_grid2", "chat_grid1", "chat_grid0", "chat_round0"]
    assert [g["policy"]["maxNumSeqs"] for g in report["grid"]] == [64, 128, 256]
    assert report["grid_best_tok_s"] == 256.0


def test_a_trial_that_cannot_decide_is_extended_once_and_judged_over_both_looks() -> None:
    """Apply mode's extension (`tuning.decide`): one window's noisy +20% is not yet significant,
    so the candidate and the policy in force each serve the same requests once more, and the
    pooled samples decide. The later looks are kept beside the first, and counted for OOMs."""
    spec = tw.classes(0, VOCAB, 8192, quick=True)[0].tuning
    base = [1000.0 + 200.0 * (i % 4) for i in range(16)]
    canary = [1.2 * x for x in base]
    looks = {
        "chat_round1": result(1650.0, 250.0, canary),
        "chat_round1_look2": {**result(1650.0, 250.0, canary), "ooms": 0.0},
        "chat_round1_baseline_look2": result(1500.0, 250.0, base),
    }
    served: list[str] = []

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        served.append(tag)
        return {**looks[tag], "policy": policy.to_api()}, None

    start = tw.classes(0, VOCAB, 8192, quick=True)[0].start
    candidate = start.model_copy(update={"max_num_seqs": 256})
    one = tune.verdict_of([looks["chat_round1"]], [result(1500.0, 250.0, base)], spec)
    assert one["verdict"] == "Inconclusive" and one["looks"] == 1, one
    trial, _ = tune.trial_looks(
        serve, candidate, start, result(1500.0, 250.0, base), "chat_round1", spec
    )
    assert served == ["chat_round1", "chat_round1_look2", "chat_round1_baseline_look2"]
    verdict = trial["verdict"]
    assert (verdict["verdict"], verdict["looks"], verdict["canarySamples"]) == ("Win", 2, 32.0)
    assert [t["policy"]["maxNumSeqs"] for t in trial["later_looks"]["candidate"]] == [256]
    assert [t["policy"]["maxNumSeqs"] for t in trial["later_looks"]["baseline"]] == [16]
    rounds = [{"round": 1, "trial": trial}]
    assert len(tune.served(rounds, [])) == 3


def test_looks_pool_samples_side_by_side_and_p99s_against_the_candidate() -> None:
    first = tt.RoundFigures([1.0, 2.0], 0.5, 0.02, {"TTFTP99": [0.4]})
    second = tt.RoundFigures([3.0], 0.9, None, {"ITLP99": [0.03]})
    canary = tt.pooled([first, second], max)
    assert canary == tt.RoundFigures(
        [1.0, 2.0, 3.0], 0.9, 0.02, {"ITLP99": [0.03], "TTFTP99": [0.4]}
    )
    assert tt.pooled([first, second], min).ttft_p99_s == 0.5
