"""pagekeeper's vLLM launcher as its own process, around `tests/vllm/fake_vllm.py` in place of
`vllm serve`: what the launcher tests and the vLLM e2e test run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.tools import REPO

FAKE_VLLM = REPO / "tests" / "vllm" / "fake_vllm.py"
STOP_TIMEOUT_S = 60.0


def start_launcher(
    tmp_path: Path,
    scenario: str,
    *,
    metrics_port: int = 0,
    capture: bool = True,
    launcher_args: Sequence[str] = ("--stuck-timeout", "0"),
    child_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """The launcher with the fake child playing `scenario`; its termination log is
    `tmp_path/<scenario>.termination-log`, and the child writes its pid to
    `tmp_path/<scenario>.waiting` once it waits for SIGTERM. The stuck probe is off unless
    `launcher_args` turn it on (the fake child serves HTTP only in its probe scenarios, on the
    `--port` of `child_args`)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "engine"), str(REPO / "memplan"), str(REPO)]),
        "FAKE_VLLM_WAITING": str(tmp_path / f"{scenario}.waiting"),
    }
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagekeeper_vllm.launch",
            "--metrics-port",
            str(metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--termination-log",
            str(tmp_path / f"{scenario}.termination-log"),
            *launcher_args,
            "--",
            sys.executable,
            str(FAKE_VLLM),
            scenario,
            "--served-model-name",
            "tiny",
            *child_args,
        ],
        env=env,
        stdout=output,
        stderr=output,
    )


def stop_launcher(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, which the launcher forwards, so no child outlives a test."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=STOP_TIMEOUT_S)
