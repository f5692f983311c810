"""The launcher ends a stuck vLLM: a zombie that holds requests and generates no token, and one
whose /health never answers, each ended within the stuck timeout (plus a generous bound) with
the `pagekeeper-stuck` termination message and a non-zero exit; the probe's pure parts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.processes import free_port
from pagekeeper_engine.stuck import parse_stuck_message
from pagekeeper_vllm.launch import exit_code
from pagekeeper_vllm.probe import vllm_url
from pagekeeper_vllm.stall import StallTracker, VllmProgress, parse_progress
from tests.support.vllm_launcher import start_launcher, stop_launcher
from tests.vllm.fake_vllm import IDLE_METRICS, STUCK_METRICS

STUCK_TIMEOUT_S = 2.0
# a bound on ending it, not a speed: the timeout, the kill grace and a generous margin
ENDED_WITHIN_S = STUCK_TIMEOUT_S + 1.0 + 60.0


def launch_probed(tmp_path: Path, scenario: str) -> subprocess.Popen[bytes]:
    return start_launcher(
        tmp_path,
        scenario,
        launcher_args=(
            "--stuck-timeout", str(STUCK_TIMEOUT_S), "--probe-interval", "0.2",
            "--stuck-kill-grace", "1",
        ),
        child_args=("--port", str(free_port())),
    )  # fmt: skip


def run_to_end(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=ENDED_WITHIN_S)
    finally:
        stop_launcher(proc)
    return proc.returncode, err.decode()


def test_a_zombie_holding_requests_is_killed_as_stuck(tmp_path: Path) -> None:
    code, err = run_to_end(launch_probed(tmp_path, "stuck"))
    assert code == 128 + 9, err  # deaf to SIGTERM: killed after the grace
    text = (tmp_path / "stuck.termination-log").read_text()
    report = parse_stuck_message(text)
    assert report is not None, text
    assert (report.num_running, report.num_waiting) == (1, 2)
    assert STUCK_TIMEOUT_S <= report.last_step_age_s < ENDED_WITHIN_S
    assert report.detail == (
        f"vLLM counted no new token for {report.last_step_age_s:.1f} s with 1 running and "
        "2 waiting (--stuck-timeout 2)"
    )
    assert f"vLLM is stuck, ending it: {report.detail}" in err
    assert "vLLM still runs 1 s after SIGTERM; killing it" in err


def test_a_vllm_whose_health_hangs_is_ended_non_zero(tmp_path: Path) -> None:
    code, err = run_to_end(launch_probed(tmp_path, "health-hangs"))
    assert code == 1, err  # it drained and exited 0 on SIGTERM
    report = parse_stuck_message((tmp_path / "health-hangs.termination-log").read_text())
    assert report is not None
    assert (report.num_running, report.num_waiting) == (0, 0)
    assert report.detail.startswith("vLLM's /health has not answered 200 for ")
    assert "still runs" not in err


def test_the_counters_are_summed_over_engines() -> None:
    assert parse_progress(STUCK_METRICS) == VllmProgress(1, 2, 42.0)
    assert parse_progress(IDLE_METRICS) == VllmProgress(0, 0, 42.0)
    assert parse_progress("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n") is None


def test_work_without_new_tokens_is_stuck_from_the_timeout_on() -> None:
    tracker = StallTracker(2.0, now_s=0.0)
    for now_s, tokens in [(0.5, 10.0), (1.0, 11.0), (2.9, 11.0)]:
        tracker.saw_health(now_s, is_healthy=True)
        tracker.saw_progress(now_s, VllmProgress(1, 0, tokens))
    assert tracker.check(2.9) is None  # a token 1.9 s ago
    report = tracker.check(3.0)
    assert report is not None
    assert (report.last_step_age_s, report.num_running, report.num_waiting) == (2.0, 1, 0)


def test_an_idle_vllm_is_never_stuck_and_an_unanswered_health_is() -> None:
    tracker = StallTracker(2.0, now_s=0.0)
    tracker.saw_progress(0.5, VllmProgress(0, 0, 10.0))
    tracker.saw_health(0.5, is_healthy=True)
    tracker.saw_progress(5.0, VllmProgress(0, 0, 10.0))
    tracker.saw_health(5.0, is_healthy=True)
    assert tracker.check(5.0) is None
    tracker.saw_health(6.0, is_healthy=False)
    assert tracker.check(6.9) is None
    report = tracker.check(7.0)
    assert report is not None and report.detail.startswith("vLLM's /health has not answered")


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        (["vllm", "serve", "m"], "http://127.0.0.1:8000"),
        (["vllm", "serve", "m", "--port", "9000", "--host", "0.0.0.0"], "http://127.0.0.1:9000"),
        (["vllm", "serve", "m", "--port=9001", "--host=10.0.0.2"], "http://10.0.0.2:9001"),
        (["vllm", "serve", "m", "--host", "::1"], "http://[::1]:8000"),
    ],
)
def test_where_vllm_listens(argv: list[str], url: str) -> None:
    assert vllm_url(argv) == url


def test_a_stuck_child_never_exits_0() -> None:
    assert exit_code(0, None, is_stuck=True) == 1
    assert exit_code(-9, None, is_stuck=True) == 137
    assert exit_code(0, None) == 0
