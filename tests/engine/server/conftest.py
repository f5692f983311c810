"""The engine's server as a real subprocess (`python -m pagekeeper_engine.cli serve ...`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from transformers import PreTrainedModel

from harness.processes import engine_pythonpath, free_port, stop_process
from tests.engine.server.checkpoint import MAX_POSITIONS, write_checkpoint
from tests.support import step_gate
from tests.support.step_gate import StepGate

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
START_TIMEOUT_S = 180.0  # imports and a model load on a busy 2-core machine
RANK_READY = re.compile(r"rank (\d+) \S+: ready \(pid (\d+)\)")


@dataclass
class Checkpoint:
    path: Path
    model: PreTrainedModel


@dataclass
class Server:
    """One engine process on 127.0.0.1, with its combined stdout/stderr in `log`."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def worker_pids(self, size: int) -> dict[int, int]:
        """The pids of tensor-parallel ranks 1..size-1, once each has logged that it is ready.

        /ready answers once rank 0 serves; a follower rank may still be freezing its start-up
        heap and connecting to its step socket, so its line can come after."""
        wanted = set(range(1, size))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            log = self.log.read_text(errors="replace")
            pids = {int(rank): int(pid) for rank, pid in RANK_READY.findall(log)}
            if set(pids) >= wanted:
                return {rank: pids[rank] for rank in sorted(wanted)}
            if self.proc.poll() is not None or time.monotonic() > deadline:
                missing = sorted(wanted - set(pids))
                raise AssertionError(f"ranks {missing} never ready:\n{log[-4000:]}")
            time.sleep(0.1)

    def stop(self) -> int:
        return stop_process(self.proc, timeout=60)


def start_server(
    checkpoint: Path, workdir: Path, *extra_flags: str, module: str = "pagekeeper_engine.cli"
) -> Server:
    """Start the server (`python -m <module> serve`) and wait until /ready answers 200."""
    port = free_port()
    argv = [
        sys.executable, "-m", module, "serve", str(checkpoint),
        "--served-model-name", MODEL_NAME,
        "--device", "cpu", "--dtype", "float32", "--load-format", "safetensors",
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", "8", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--num-gpu-blocks-override", "64",
        "--num-cpu-blocks-override", "16",
        *extra_flags,
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = engine_pythonpath()
    log = workdir / f"engine-{port}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    server = Server(proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"engine not ready within {START_TIMEOUT_S} s:\n{server.log_tail()}")


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StepGate:
    """A shut step gate for a server started with `module=step_gate.MODULE`: its core takes no
    step until the test allows one (`tests/support/step_gate.py`)."""
    gate = StepGate(tmp_path / "step-gate")
    gate.allow(0)
    monkeypatch.setenv(step_gate.STEP_GATE_ENV, str(gate.path))
    return gate


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = tmp_path_factory.mktemp("tiny-llama")
    model = write_checkpoint(path)
    assert model.config.max_position_embeddings == MAX_POSITIONS
    return Checkpoint(path, model)


@pytest.fixture(scope="session")
def server(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server shared by the tests that do not stop it."""
    server = start_server(checkpoint.path, tmp_path_factory.mktemp("server"))
    yield server
    assert server.stop() == 0, server.log_tail()
