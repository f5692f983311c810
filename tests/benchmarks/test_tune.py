"""W-tune: the classes' requests, the window read from /metrics, and a smoke run on the CPU."""

from __future__ import annotations

from pathlib import Path

from benchmarks import tune
from benchmarks import tune_workload as tw
from benchmarks.serving_workload import RequestRecord
from pagekeeper_operator.tuning.window import MetricWindow
from tests.support.cpu_engine import write_tiny_checkpoint

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
    chat, rag, burst = tw.classes(0, VOCAB, 8192, quick=True)
    assert (chat.concurrency, len(chat.work.prompts), chat.start.max_num_seqs) == (128, 256, 16)
    assert all(64 <= len(p) <= 512 for p in chat.work.prompts)
    prefixes = {tuple(p[: tw.RAG_PREFIX_LEN]) for p in rag.work.prompts}
    assert len(prefixes) == tw.RAG_PREFIXES
    assert all(32 <= len(p) - tw.RAG_PREFIX_LEN <= 4096 for p in rag.work.prompts)
    assert (rag.start.enable_prefix_caching, rag.start.block_size) == (False, 32)
    long_ones = [
        t for t, p in zip(burst.arrivals, burst.work.prompts, strict=True) if len(p) >= 3000
    ]
    assert sorted(set(long_ones)) == [0.0, 20.0] and len(long_ones) == 2 * tw.BURST_SIZE
    assert burst.arrivals == sorted(burst.arrivals)
    assert burst.start.gpu_memory_utilization == 0.7
    for cls in (chat, rag, burst):
        assert cls.start in cls.grid or cls.name == "rag"


def test_a_smoke_round_on_the_cpu(tmp_path: Path) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    report = tune.main([
        "--device", "cpu", "--model-dir", str(model_dir), "--classes", "chat", "--rounds", "2",
        "--scale", "0.05", "--num-requests", "12", "--no-grid", "--client-processes", "1",
        "--max-model-len", "512", "--sample-interval", "0.2", "--start-timeout", "180",
        "--fixtures", str(tmp_path / "fixtures"),
    ])  # fmt: skip
    [chat] = report["classes"]
    [first] = chat["rounds"]  # 12 requests are too few for any rule: no change, no second round
    assert first["recommendation"] is None
    assert first["failures"] == {} and first["output_tok_s"] > 0
    assert first["policy"]["maxNumSeqs"] == 16
    saved = MetricWindow.from_json((tmp_path / "fixtures" / "chat_round0.json").read_text())
    assert saved.num_requests == 12.0


def test_a_burst_round_splits_its_arrivals_over_the_client_processes() -> None:
    burst = tw.classes(0, VOCAB, 8192, quick=True)[2]
    args = tune.parse_args(["--client-processes", "3"])
    plans = tune.open_loop_plans("http://e", burst, args)
    assert [p.num_streams for p in plans] == [0, 0, 0]
    assert sorted(i for p in plans for i, _ in p.arrivals) == list(range(len(burst.arrivals)))
    assert all(p.warmup == [] and p.prompts is burst.work.prompts for p in plans)
