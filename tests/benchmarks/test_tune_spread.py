"""W-tune's spread between engine starts: the serving order, the per-point summary, bad points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import tune_spread
from benchmarks import tune_workload as tw
from harness.cpu_engine import write_tiny_checkpoint
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.tuning.window import MetricWindow
from tests.benchmarks.test_tune import VOCAB, result


def test_passes_alternate_direction_so_no_point_always_follows_another() -> None:
    assert tune_spread.serving_order([1, 2], 3) == [(0, 1), (0, 2), (1, 2), (1, 1), (2, 1), (2, 2)]
    assert tune_spread.serving_order([0, 1, 2], 2) == [
        (0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0),
    ]  # fmt: skip
    with pytest.raises(AssertionError):
        tune_spread.serving_order([1], 0)


def test_each_point_gets_its_scores_in_serving_order_mean_spread_and_overlap() -> None:
    """The scripted throughputs of points 1 and 2 overlap (2's best serving beats 1's worst);
    point 0 lies wholly below them."""
    served: list[str] = []
    scripted = {1: iter([5000.0, 4700.0, 5900.0]), 2: iter([5600.0, 4750.0, 5200.0]),
                0: iter([3200.0, 3500.0, 3300.0])}  # fmt: skip

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        served.append(tag)
        point = {64: 0, 128: 1, 256: 2}[policy.max_num_seqs]
        return {**result(next(scripted[point]), 200.0, []), "policy": policy.to_api()}, None

    chat = tw.classes(0, VOCAB, 8192, quick=True)[0]
    args = tune_spread.parse_args(["--points", "1", "2", "0", "--repeats", "3"])
    report = tune_spread.run_class(chat, args, serve)
    assert served[:4] == ["chat_pass0_point1", "chat_pass0_point2", "chat_pass0_point0",
                          "chat_pass1_point0"]  # fmt: skip
    assert len(served) == 9
    low, mid, top = report["points"]  # in the grid's order
    assert [p["policy"]["maxNumSeqs"] for p in (low, mid, top)] == [64, 128, 256]
    assert mid["scores"] == [5000.0, 4700.0, 5900.0]
    assert mid["mean"] == pytest.approx(5200.0) and top["mean"] == pytest.approx(5183.333, 1e-3)
    assert mid["share_of_best_mean"] == 1.0 and top["share_of_best_mean"] < 1.0
    assert mid["spread"] == pytest.approx(1200.0 / 5200.0)
    assert (mid["overlaps_best"], top["overlaps_best"], low["overlaps_best"]) == (
        True,
        True,
        False,
    )


def test_a_serving_that_failed_scores_zero_and_counts_in_the_mean() -> None:
    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        if tag == "chat_pass1_point1":
            return {"policy": policy.to_api(), "error": "CUDA out of memory at start-up"}, None
        return {**result(4000.0, 200.0, []), "policy": policy.to_api()}, None

    chat = tw.classes(0, VOCAB, 8192, quick=True)[0]
    report = tune_spread.run_class(chat, tune_spread.parse_args(["--points", "1"]), serve)
    [point] = report["points"]
    assert point["scores"] == [4000.0, 0.0, 4000.0]
    assert point["lowest"] == 0.0 and point["mean"] == pytest.approx(8000.0 / 3)


def test_points_outside_the_grid_and_no_passes_are_refused() -> None:
    chat = tw.classes(0, VOCAB, 8192, quick=True)[0]

    def serve(policy: MemoryPolicy, tag: str) -> tuple[dict[str, Any], MetricWindow | None]:
        raise AssertionError("nothing is served for a bad point")

    with pytest.raises(SystemExit, match=r"--points \[3\]: chat's grid has points 0 to 2"):
        tune_spread.run_class(chat, tune_spread.parse_args(["--points", "1", "3"]), serve)
    with pytest.raises(SystemExit):
        tune_spread.parse_args(["--repeats", "0"])


def test_a_smoke_pass_on_the_cpu(tmp_path: Path) -> None:
    """Two grid points, one pass, over real CPU engines: both served, the report written."""
    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "spread.json"
    report = tune_spread.main([
        "--device", "cpu", "--model-dir", str(model_dir), "--classes", "chat",
        "--points", "0", "1", "--repeats", "1", "--scale", "0.05", "--num-requests", "12",
        "--client-processes", "1", "--max-model-len", "512", "--sample-interval", "0.2",
        "--start-timeout", "180", "--json", str(out),
    ])  # fmt: skip
    [chat] = report["classes"]
    assert [(s["pass"], s["point"]) for s in chat["servings"]] == [(0, 0), (0, 1)]
    assert all(s["trial"]["failures"] == {} for s in chat["servings"])
    assert [p["differs"] for p in chat["points"]] == [{"maxNumSeqs": 64}, {"maxNumSeqs": 128}]
    assert json.loads(out.read_text())["classes"][0]["servings"][0]["point"] == 0
