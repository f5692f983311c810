"""memory_load's readings: the per-rank budgets parsed from what the engine's collector really
exports, nvidia-smi's per-GPU figures, and each rank's peak held against its own budget."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks.memory_load import (
    MiB,
    gpu_used_mib,
    parse_budgets,
    parse_gpu_used,
    rank_memory,
    workload_failures,
)
from pagekeeper_engine.frontend.metrics import EngineCollector, ServerMetrics
from tests.engine.server.test_metrics import make_ready, make_stats

BUDGETS = [
    {"allowed": 100 * MiB, "weights": 40 * MiB, "kv_cache": 50 * MiB},
    {"allowed": 100 * MiB, "weights": 40 * MiB, "kv_cache": 48 * MiB},
]


def test_budgets_parse_per_rank_from_the_engines_exposition() -> None:
    collector = EngineCollector(
        "m", make_stats, lambda: False, lambda: make_ready([dict(b) for b in BUDGETS])
    )
    text = ServerMetrics("m", collector).render().decode()
    assert parse_budgets(text) == [{k: float(v) for k, v in b.items()} for b in BUDGETS]


def test_no_budget_exported_yet_parses_to_no_rank() -> None:
    collector = EngineCollector("m", lambda: None, lambda: False)
    assert parse_budgets(ServerMetrics("m", collector).render().decode()) == []


def test_nvidia_smi_figures_per_gpu() -> None:
    assert parse_gpu_used("81234\n79000\n") == [81234.0, 79000.0]
    assert parse_gpu_used("") == []


def test_each_rank_against_its_own_budget() -> None:
    budgets = [{k: float(v) for k, v in b.items()} for b in BUDGETS]
    series: list[dict[str, Any]] = [
        {"gpu_used_mib": [90.0, 95.0]},
        {"gpu_used_mib": [99.0, 101.0]},  # rank 1 over its 100 MiB
        {"gpu_used_mib": []},  # nvidia-smi could not say
    ]
    ranks = rank_memory(series, budgets)
    assert ranks == [
        {"rank": 0, "peak_used_mib": 99.0, "allowed_mib": 100.0, "within": True},
        {"rank": 1, "peak_used_mib": 101.0, "allowed_mib": 100.0, "within": False},
    ]
    (unread,) = rank_memory([{"gpu_used_mib": []}], budgets[:1])
    assert math.isnan(unread["peak_used_mib"]) and unread["within"] is False


def test_a_host_without_nvidia_smi_reads_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_used_mib() == []


def burst_result(**changes: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "lost": 0,
        "lost_reasons": {},
        "oom_events": {"pagekeeper_oom_events_total{step}": 0.0},
        "ranks": [{"rank": 0, "peak_used_mib": 99.0, "allowed_mib": 100.0, "within": True}],
        "server_exit_code": 0,
    }
    return {**result, **changes}


def test_a_run_passes_only_with_nothing_lost_no_oom_and_every_rank_within() -> None:
    assert workload_failures(burst_result()) == []
    assert workload_failures(
        burst_result(
            lost=2,
            lost_reasons={"http 500": 2},
            oom_events={"pagekeeper_oom_events_total{step}": 1.0},
            ranks=[
                {"rank": 1, "peak_used_mib": 136067.0, "allowed_mib": 135998.1, "within": False}
            ],
            server_exit_code=1,
        )
    ) == [
        "2 requests lost ({'http 500': 2})",
        "pagekeeper_oom_events_total{step} = 1",
        "rank 1 peaked at 136,067 MiB of the 135,998 its budget allowed",
        "the server exited with 1",
    ]
    assert workload_failures(burst_result(ranks=[])) == ["no rank's budget was read"]


def test_capacity_fails_on_a_peak_past_the_allowed_share_or_allocations_beside_the_terms() -> None:
    from benchmarks.memory import capacity_failures  # noqa: PLC0415

    within = {
        "peak_within_allowed": True,
        "device_peak_used_estimate": 90 * MiB,
        "allowed": 100 * MiB,
        "allocated_beyond_terms_at_ready": -3 * MiB,
    }
    assert capacity_failures(within) == []
    over = {
        **within,
        "peak_within_allowed": False,
        "device_peak_used_estimate": 101 * MiB,
        "allocated_beyond_terms_at_ready": 2 * MiB,
    }
    assert capacity_failures(over) == [
        "the worst-case step peaked at 105,906,176 bytes of the 104,857,600 allowed",
        "ready, the allocator held 2,097,152 bytes beyond the weights, the KV pool and the peak "
        "activations",
    ]
