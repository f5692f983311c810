"""`pagekeeper-vllm-launch` around real child processes that print vLLM's real texts.

Each test runs the launcher as its own process (as the container's PID 1 would), with
`fake_vllm.py` as the child; signals are sent to the launcher, never to the child.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.cluster import wait_for
from harness.processes import engine_pythonpath, free_port
from harness.tools import REPO
from pagekeeper_vllm.launch import Launcher
from pagekeeper_vllm.pipes import ChildPipe
from tests.support.vllm_launcher import start_launcher, stop_launcher
from tests.vllm.fake_vllm import OOM, PREFIX, READY

HERE = Path(__file__).parent
WAIT_S = 60.0


def launch(tmp_path: Path, scenario: str, metrics_port: int = 0) -> subprocess.Popen[bytes]:
    """One launcher per test (each has its own tmp_path)."""
    return start_launcher(tmp_path, scenario, metrics_port=metrics_port)


def termination_log(tmp_path: Path) -> Path:
    return next(tmp_path.glob("*.termination-log"), tmp_path / "no.termination-log")


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, out.decode(), err.decode()


def wait_waiting(tmp_path: Path) -> int:
    """The child's pid once it waits for SIGTERM (it writes the marker file then)."""
    deadline = time.monotonic() + WAIT_S
    while not (marker := next(tmp_path.glob("*.waiting"), None)) or not marker.read_text():
        assert time.monotonic() < deadline, "the child never got ready"
        time.sleep(0.02)
    return int(marker.read_text())


def test_an_oom_death_that_vllm_exits_0_from_is_exit_1_with_the_message(tmp_path: Path) -> None:
    code, out, err = finish(launch(tmp_path, "runtime-oom"))
    assert code == 1
    assert termination_log(tmp_path).read_text() == (
        "pagekeeper-oom kind=gpu phase=runtime detail=vLLM: CUDA out of memory (tried to "
        "allocate 384.00 MiB; GPU 0: 329.87 MiB free of 19.53 GiB; 402.27 MiB reserved by "
        "PyTorch but unallocated)\n"
    )
    # Everything else passes through untouched, progress bars' carriage returns included.
    assert out.startswith("INFO 11-24 19:00:00 [api_server.py:1] vLLM API server version")
    assert "Loading safetensors checkpoint shards:  50% Completed | 1/2\r\n" in err
    assert f"(EngineCore_DP0 pid=4242) {OOM}\n" in out
    assert "vLLM ended by running out of GPU memory (runtime, exit 0)" in err


def test_a_start_up_memory_error_keeps_vllms_code(tmp_path: Path) -> None:
    code, _, _ = finish(launch(tmp_path, "startup-no-cache"))
    assert code == 1
    assert termination_log(tmp_path).read_text() == (
        "pagekeeper-oom kind=gpu phase=startup detail=vLLM: no available memory for the KV "
        "cache blocks after loading and profiling (gpuMemoryUtilization too low for the "
        "model)\n"
    )


def test_a_clean_exit_is_0_with_no_message(tmp_path: Path) -> None:
    code, _, err = finish(launch(tmp_path, "clean"))
    assert code == 0
    assert "Application startup complete." in err
    assert not termination_log(tmp_path).exists()


def test_a_child_killed_by_a_signal_exits_128_plus_it(tmp_path: Path) -> None:
    code, _, _ = finish(launch(tmp_path, "killed"))
    assert code == 128 + signal.SIGKILL
    assert not termination_log(tmp_path).exists()


def test_sigterm_reaches_the_child_which_drains(tmp_path: Path) -> None:
    proc = launch(tmp_path, "drain")
    wait_waiting(tmp_path)
    proc.send_signal(signal.SIGTERM)
    code, out, _ = finish(proc)
    assert code == 0
    assert out.rstrip().endswith("INFO:     Shutting down")
    assert not termination_log(tmp_path).exists()


def test_an_oom_during_the_drain_is_reported(tmp_path: Path) -> None:
    proc = launch(tmp_path, "oom-while-draining")
    wait_waiting(tmp_path)
    proc.send_signal(signal.SIGTERM)
    code, _, _ = finish(proc)
    assert code == 1
    assert "phase=runtime" in termination_log(tmp_path).read_text()


def test_an_oom_vllm_survived_is_no_cause_of_a_clean_drain(tmp_path: Path) -> None:
    proc = launch(tmp_path, "survived-oom-then-drain")
    wait_waiting(tmp_path)
    proc.send_signal(signal.SIGTERM)
    code, _, _ = finish(proc)
    assert code == 0
    assert not termination_log(tmp_path).exists()


def test_an_oom_line_still_in_the_pipe_at_the_stop_comes_before_it() -> None:
    """The stop's handler takes what the pipes hold before it marks the drain's start: a memory
    error vLLM survived and printed before SIGTERM, unread by the pumps when the signal came, is
    no cause of the drain's exit (no pump runs here, so the line is in the pipe for certain)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    read_end, write_end = os.pipe()
    try:
        sink = io.BytesIO()
        launcher = Launcher(["vllm", "serve", "tiny"], None, "tiny")
        launcher.pipes = [ChildPipe(os.fdopen(read_end, "rb", buffering=0), sink)]
        launcher.child = child
        text = f"{READY}\n{PREFIX}{OOM}\n".encode()
        os.write(write_end, text)
        launcher._forward(signal.SIGTERM, None)
        assert launcher.stop_line == 2
        assert launcher.cause() is None
        assert sink.getvalue() == text
        assert child.wait(timeout=WAIT_S) == -signal.SIGTERM
    finally:
        os.close(write_end)
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_program_that_cannot_run_is_127(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagekeeper_vllm.launch", "--", str(tmp_path / "no-vllm")],
        env={**os.environ, "PYTHONPATH": engine_pythonpath()},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert result.returncode == 127
    assert f"cannot run {tmp_path / 'no-vllm'}" in result.stderr


def test_no_command_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagekeeper_vllm.launch"],
        env={**os.environ, "PYTHONPATH": str(REPO / "engine")},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert result.returncode == 2
    assert "give vLLM's command after --" in result.stderr


@pytest.mark.parametrize("scenario", ["drain"])
def test_sigint_is_forwarded_once(tmp_path: Path, scenario: str) -> None:
    """The child runs in its own process group: only the launcher's forward reaches it."""
    proc = launch(tmp_path, scenario)
    child = wait_waiting(tmp_path)
    assert os.getpgid(child) == child != os.getpgid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 0


def test_the_metrics_endpoint_serves_the_gpu_processes_reports(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port()
    proc = launch(tmp_path, "report", metrics_port=port)
    request.addfinalizer(lambda: stop_launcher(proc))
    wait_waiting(tmp_path)

    def scrape() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text: str = reply.read().decode()
        except OSError:
            return None
        return text if "pagekeeper_allocator_reserved_bytes" in text else None

    text = wait_for(scrape, timeout=WAIT_S, what="the allocator series served")
    assert f'pagekeeper_allocator_reserved_bytes{{model_name="tiny",rank="0"}} {8 << 30}\n' in text
    assert "pagekeeper_allocator_fragmentation_bytes{" in text and f" {7 << 30}\n" in text
    assert "pagekeeper_oom_events_total{model_name=" in text
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    assert info.value.code == 404
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 0
