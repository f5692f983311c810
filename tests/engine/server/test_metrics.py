"""/metrics: every contract name, with the values the engine and the server report."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_engine.core.limits import EngineLimits
from pagekeeper_engine.core.stats import STEP_SECONDS_BUCKETS, DurationCounts, GrammarTimings
from pagekeeper_engine.frontend.metric_names import CUDA_ONLY, METRICS, OOM_KINDS, family_name
from pagekeeper_engine.frontend.metrics import EngineCollector, RequestTimer, ServerMetrics
from pagekeeper_engine.memory.allocator import AllocatorSettings, AllocatorStats
from pagekeeper_engine.memory.oom import OOM_EVENT_KINDS
from pagekeeper_engine.messages import PROTOCOL_VERSION, LoopStats, Ready
from tests.engine.server.checkpoint import encode
from tests.engine.server.conftest import MODEL_NAME, Server

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def make_stats(**overrides: Any) -> LoopStats:
    values: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(LoopStats)}
    values["kv_cache_usage"] = 0.0
    values["kv_internal_fragmentation"] = 0.0
    for defaulted in ("num_requests_success", "num_oom_events", "allocator", "grammar"):
        del values[defaulted]
    values.update(overrides)
    return LoopStats(**values)


def make_ready(budget: list[dict[str, int]] | None) -> Ready:
    return Ready(
        protocol_version=PROTOCOL_VERSION,
        limits=EngineLimits(4096, 8192, 256, 2304),
        block_size=16,
        num_gpu_blocks=1000,
        num_cpu_blocks=50,
        kv_cache_dtype="bfloat16",
        memory_budget_bytes=budget,
        has_allocator=True,
        is_async_scheduling=True,
        stats=make_stats(),
    )


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """Family name -> type, and (sample name, sorted labels) -> value."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def label(model: str = MODEL_NAME, **labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model_name": model, **labels}.items()))


def test_collector_exports_engine_stats_exactly() -> None:
    stats = make_stats(
        num_running=3, num_waiting=7, kv_cache_usage=0.25, num_gpu_blocks=100,
        num_free_blocks=75, num_used_blocks=25, num_cached_blocks=30, num_cache_only_blocks=10,
        kv_internal_fragmentation=0.125, num_swap_blocks_used=4, prefix_cache_queries=90,
        prefix_cache_hits=40, num_preemptions=2, num_prompt_tokens=500,
        num_generation_tokens=800, num_requests_success={"stop": 5, "length": 6, "abort": 1},
        num_oom_events={"step": 3, "swap": 1, "startup": 0}, step_token_budget=2048,
        device_wait_seconds=1.5, prefix_cache_shadow_hits=64,
    )  # fmt: skip
    collector = EngineCollector("m", lambda: stats, lambda: True)
    types, samples = parse(ServerMetrics("m", collector).render().decode())
    expected = {
        ("pagekeeper_drain_state", label("m")): 1.0,
        ("vllm:num_requests_running", label("m")): 3.0,
        ("vllm:num_requests_waiting", label("m")): 7.0,
        ("vllm:kv_cache_usage_perc", label("m")): 0.25,
        ("vllm:prefix_cache_queries_total", label("m")): 90.0,
        ("vllm:prefix_cache_hits_total", label("m")): 40.0,
        ("pagekeeper_prefix_cache_shadow_hits_total", label("m")): 64.0,
        ("vllm:num_preemptions_total", label("m")): 2.0,
        ("vllm:prompt_tokens_total", label("m")): 500.0,
        ("vllm:generation_tokens_total", label("m")): 800.0,
        ("vllm:request_success_total", label("m", finished_reason="stop")): 5.0,
        ("vllm:request_success_total", label("m", finished_reason="length")): 6.0,
        ("vllm:request_success_total", label("m", finished_reason="abort")): 1.0,
        # free 75 counts the 10 blocks held only by the prefix cache: they are `cached`.
        ("pagekeeper_kv_blocks", label("m", state="free")): 65.0,
        ("pagekeeper_kv_blocks", label("m", state="used")): 25.0,
        ("pagekeeper_kv_blocks", label("m", state="cached")): 10.0,
        ("pagekeeper_kv_internal_fragmentation_ratio", label("m")): 0.125,
        ("pagekeeper_swap_blocks_used", label("m")): 4.0,
        ("pagekeeper_oom_events_total", label("m", kind="step")): 3.0,
        ("pagekeeper_oom_events_total", label("m", kind="swap")): 1.0,
        ("pagekeeper_oom_events_total", label("m", kind="startup")): 0.0,
        ("pagekeeper_step_token_budget", label("m")): 2048.0,
        ("pagekeeper_device_wait_seconds_total", label("m")): 1.5,
    }
    assert {k: samples[k] for k in expected} == expected
    # No allocator reading and no budget: those series are absent, not zero.
    assert not CUDA_ONLY & set(types)
    for name, (kind, _) in METRICS.items():
        if name not in CUDA_ONLY and name not in {
            "pagekeeper_allocator_config_info",
            "vllm:cache_config_info",  # once the core's handshake says what the cache is
        }:
            assert types[family_name(name)] == kind, name


def test_grammar_timings_are_exported_as_cumulative_histograms() -> None:
    """Each of `GrammarTimings`' histograms under its name, the fill's parts by `part`: the
    buckets cumulative over `STEP_SECONDS_BUCKETS`, then +Inf, with the count and sum."""
    assert STEP_SECONDS_BUCKETS[:5] == (0.0001, 0.00025, 0.0005, 0.00075, 0.001)
    empty = [0] * (len(STEP_SECONDS_BUCKETS) + 1)

    def durations(*placed: tuple[int, int], sum_seconds: float) -> DurationCounts:
        counts = list(empty)
        for index, count in placed:
            counts[index] = count
        return DurationCounts(tuple(counts), sum_seconds)

    grammar = GrammarTimings(
        fill=durations((0, 2), (4, 1), (len(empty) - 1, 1), sum_seconds=0.25),
        wait=durations((1, 3), sum_seconds=0.0006),
        fill_bitmask=durations((2, 5), sum_seconds=0.002),
    )
    collector = EngineCollector("m", lambda: make_stats(grammar=grammar), lambda: False)
    types, samples = parse(ServerMetrics("m", collector).render().decode())
    fill = "pagekeeper_grammar_fill_seconds"
    assert [
        samples[(f"{fill}_bucket", label("m", le=le))]
        for le in ("0.0001", "0.00025", "0.00075", "0.001", "0.05", "+Inf")
    ] == [2, 2, 2, 3, 3, 4]
    assert samples[(f"{fill}_count", label("m"))] == 4.0
    assert samples[(f"{fill}_sum", label("m"))] == 0.25
    wait = "pagekeeper_grammar_wait_seconds"
    assert samples[(f"{wait}_bucket", label("m", le="0.0001"))] == 0.0
    assert samples[(f"{wait}_bucket", label("m", le="0.00025"))] == 3.0
    assert samples[(f"{wait}_sum", label("m"))] == 0.0006
    part = "pagekeeper_grammar_fill_part_seconds"
    assert samples[(f"{part}_count", label("m", part="bitmask"))] == 5.0
    assert samples[(f"{part}_bucket", label("m", part="bitmask", le="0.0005"))] == 5.0
    for name in ("device_wait", "accept", "host_ops"):
        assert samples[(f"{part}_count", label("m", part=name))] == 0.0
    for name in ("queue", "apply"):
        assert samples[(f"pagekeeper_grammar_{name}_seconds_count", label("m"))] == 0.0
    assert {types[n] for n in (fill, wait, part)} == {"histogram"}


def test_allocator_reading_budget_and_allocator_settings() -> None:
    allocator = AllocatorStats(
        reserved=1000, allocated=700, largest_free_block=200, num_alloc_retries=2, num_ooms=0
    )
    stats = make_stats(allocator=allocator, step_token_budget=64)
    settings = AllocatorSettings(
        "PYTORCH_CUDA_ALLOC_CONF", {"expandable_segments": "True", "other": "1"}
    )
    collector = EngineCollector(
        "m",
        lambda: stats,
        lambda: False,
        lambda: make_ready([{"weights": 10, "kv_cache": 20}, {"weights": 10, "kv_cache": 18}]),
        settings,
    )
    types, samples = parse(ServerMetrics("m", collector).render().decode())
    wanted = {
        k: v
        for k, v in samples.items()
        if k[0].startswith(("pagekeeper_allocator", "pagekeeper_memory", "vllm:cache_config"))
    }
    assert wanted == {
        ("pagekeeper_allocator_reserved_bytes", label("m")): 1000.0,
        ("pagekeeper_allocator_allocated_bytes", label("m")): 700.0,
        ("pagekeeper_allocator_fragmentation_bytes", label("m")): 300.0,
        ("pagekeeper_allocator_largest_free_segment_bytes", label("m")): 200.0,
        ("pagekeeper_allocator_alloc_retries_total", label("m")): 2.0,
        (
            "pagekeeper_allocator_config_info",
            label(
                "m",
                variable="PYTORCH_CUDA_ALLOC_CONF",
                expandable_segments="True",
                garbage_collection_threshold="",
                max_split_size_mb="",
            ),
        ): 1.0,
        ("pagekeeper_memory_budget_bytes", label("m", term="kv_cache", rank="0")): 20.0,
        ("pagekeeper_memory_budget_bytes", label("m", term="weights", rank="0")): 10.0,
        ("pagekeeper_memory_budget_bytes", label("m", term="kv_cache", rank="1")): 18.0,
        ("pagekeeper_memory_budget_bytes", label("m", term="weights", rank="1")): 10.0,
        (
            "vllm:cache_config_info",
            label(
                "m",
                block_size="16",
                num_gpu_blocks="1000",
                num_cpu_blocks="50",
                cache_dtype="bfloat16",
            ),
        ): 1.0,
    }
    for name, (kind, _) in METRICS.items():
        assert types[family_name(name)] == kind, name


def test_loading_exports_only_drain_state_rejections_and_settings() -> None:
    collector = EngineCollector("m", lambda: None, lambda: False, None, AllocatorSettings(""))
    types, samples = parse(ServerMetrics("m", collector).render().decode())
    assert {k: v for k, v in samples.items() if k[0].startswith("pagekeeper_")} == {
        ("pagekeeper_drain_state", label("m")): 0.0,
        (
            "pagekeeper_allocator_config_info",
            label(
                "m",
                variable="",
                expandable_segments="",
                garbage_collection_threshold="",
                max_split_size_mb="",
            ),
        ): 1.0,
        ("pagekeeper_requests_rejected_total", label("m", reason="overloaded")): 0.0,
        ("pagekeeper_requests_rejected_total", label("m", reason="draining")): 0.0,
        ("pagekeeper_requests_rejected_total", label("m", reason="loading")): 0.0,
    }
    assert "vllm:num_requests_running" not in types  # no engine yet: loading


def test_oom_kinds_of_the_contract_are_the_engines() -> None:
    assert OOM_KINDS == OOM_EVENT_KINDS == ("step", "swap", "startup")


def test_request_timer_observes_each_token() -> None:
    metrics = ServerMetrics("m", EngineCollector("m", lambda: None, lambda: False))
    timer = RequestTimer(metrics, arrival_s=10.0)
    timer.on_tokens(1, now_s=10.5)  # first token after 0.5 s
    timer.on_tokens(0, now_s=10.6)  # held-back text: no token left
    timer.on_tokens(2, now_s=11.5)  # two tokens at once share the 1 s gap
    timer.on_finish(now_s=12.0)
    _, samples = parse(metrics.render().decode())
    assert samples[("vllm:time_to_first_token_seconds_sum", label("m"))] == 0.5
    assert samples[("vllm:inter_token_latency_seconds_count", label("m"))] == 2.0
    assert samples[("vllm:inter_token_latency_seconds_sum", label("m"))] == 1.0
    assert samples[("vllm:e2e_request_latency_seconds_sum", label("m"))] == 2.0
    bucket = ("vllm:inter_token_latency_seconds_bucket", label("m", le="0.5"))
    assert samples[bucket] == 2.0


def test_metric_names_are_valid_and_documented() -> None:
    for name, (kind, _) in METRICS.items():
        assert name.startswith(("vllm:", "pagekeeper_")), name
        assert name.endswith("_total") == (kind == "counter"), name


def scrape(server: Server) -> tuple[dict[str, str], Samples]:
    response = requests.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    return parse(response.text)


def test_live_scrape_has_every_contract_name(server: Server) -> None:
    types, samples = scrape(server)
    for name, (kind, extra_labels) in METRICS.items():
        family = family_name(name)
        if name in CUDA_ONLY:
            assert family not in types, f"{name} is faked on the CPU"
            continue
        assert types.get(family) == kind, name
        for (sample_name, labels), _ in samples.items():
            if sample_name.startswith(family):
                assert dict(labels)["model_name"] == MODEL_NAME
                assert set(dict(labels)) - {"model_name", "le"} == set(extra_labels), name


def test_the_endpoint_pickers_model_server_protocol(server: Server) -> None:
    """What the Gateway API Inference Extension's endpoint picker reads from a model server:
    queue length and running requests as gauges, KV-cache usage as a 0-1 gauge, and the cache's
    block size and block count as labels of `vllm:cache_config_info`."""
    types, samples = scrape(server)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert types[name] == "gauge", name
        assert samples[(name, label())] >= 0
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert 0.0 <= samples[("vllm:kv_cache_usage_perc", label())] <= 1.0
    assert types["vllm:cache_config_info"] == "gauge"
    [(labels, value)] = [
        (dict(k[1]), v) for k, v in samples.items() if k[0] == "vllm:cache_config_info"
    ]
    assert value == 1.0
    # the server fixture's --block-size 8 and --num-gpu-blocks-override 64, as the core has them
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("8", "64")


def test_live_counters_move_by_one_request(server: Server) -> None:
    _, before = scrape(server)
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "count me",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    _, after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, label(**labels))
        return after[key] - before.get(key, 0.0)

    num_prompt = len(encode("count me"))
    assert delta("vllm:prompt_tokens_total") == num_prompt
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:prefix_cache_queries_total") == num_prompt
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 7
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert after[("vllm:num_requests_running", label())] == 0
    assert after[("pagekeeper_kv_blocks", label(state="used"))] == 0
    assert after[("pagekeeper_drain_state", label())] == 0


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_while_serving(server: Server, path: str) -> None:
    response = requests.get(f"{server.url}{path}", timeout=10)
    assert response.status_code == 200
