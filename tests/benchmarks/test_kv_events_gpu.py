"""`benchmarks/kv_events_gpu.sh` in its CPU smoke mode: each of the four server starts serves
both loads in full, each server with events on starts its publisher and none with them off
does, and the report holds both loads' on/off ratios (their values on two busy cores say
nothing; the GPU run is what measures them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from harness.processes import engine_pythonpath, free_port

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_events_gpu.sh"


def test_the_smoke_run_serves_every_pass_and_reports_both_ratios(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SMOKE": "1",
        "OUT": str(tmp_path),
        "PYTHONPATH": engine_pythonpath(),
        "KV_EVENTS_PORT": str(free_port()),
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "kv_events.json").read_text())
    assert set(report["ratios"]) == {"nano", "chat"}
    assert all(ratio > 0 for ratio in report["ratios"].values())
    assert report["failed"] == []
    assert sorted(report["passes"]) == sorted(
        f"{load}-{events}-{repeat}"
        for load in ("nano", "chat") for events in ("off", "on") for repeat in (1, 2)
    )  # fmt: skip
    for name, figures in report["passes"].items():
        assert figures["num_ok"] == figures["num_requests"] > 0, name
    logs = tmp_path / "kv_events_logs"
    for repeat in (1, 2):
        assert "publishing KV events" in (logs / f"on-{repeat}.log").read_text()
        assert "publishing KV events" not in (logs / f"off-{repeat}.log").read_text()
