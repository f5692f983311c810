"""SIGTERM drains: readiness fails at once, new work gets 503, running streams finish, exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.engine.server.conftest import (
    LONG_CONTEXT,
    MODEL_NAME,
    Server,
    start_server,
)
from tests.support.processes import engine_pythonpath, free_port

NUM_STREAMS = 3
MAX_TOKENS = 600  # seconds of work at several ms per step: still running at SIGTERM


def open_stream(server: Server, max_tokens: int) -> requests.Response:
    body: dict[str, Any] = {
        "model": MODEL_NAME, "prompt": "drain me", "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    response = requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=60)
    assert response.status_code == 200
    return response


def read_events(lines: Any) -> list[Any]:
    """Every event of an SSE stream up to [DONE], decoded."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith(b"data: ")
        if line == b"data: [DONE]":
            return events
        events.append(json.loads(line[len(b"data: ") :]))
    raise AssertionError("stream ended without [DONE]")


def start(checkpoint: Path, workdir: Path, shutdown_timeout_s: int) -> Server:
    return start_server(
        checkpoint, workdir, "--max-model-len", str(LONG_CONTEXT),
        "--num-gpu-blocks-override", "1024", "--shutdown-timeout", str(shutdown_timeout_s),
    )  # fmt: skip


# The drain's deadline is not what this test measures: a CPU shared with other work can take
# far more than a minute for the streams, and a shorter deadline would abort them. The test's
# own timeout bounds it instead.
PATIENT_SHUTDOWN_TIMEOUT_S = 3600


@pytest.fixture
def drain_server(long_checkpoint: Path, tmp_path: Path) -> Iterator[Server]:
    server = start(long_checkpoint, tmp_path, shutdown_timeout_s=PATIENT_SHUTDOWN_TIMEOUT_S)
    yield server
    server.stop()  # only does something when the test failed before the process exited


@pytest.fixture
def impatient_server(long_checkpoint: Path, tmp_path: Path) -> Iterator[Server]:
    server = start(long_checkpoint, tmp_path, shutdown_timeout_s=1)
    yield server
    server.stop()


def test_sigterm_during_streams_lets_them_finish(drain_server: Server) -> None:
    server = drain_server
    streams = [open_stream(server, MAX_TOKENS) for _ in range(NUM_STREAMS)]
    iterators = [s.iter_lines() for s in streams]
    firsts = [next(it) for it in iterators]  # every stream has produced a token
    assert all(f.startswith(b"data: {") for f in firsts)

    server.proc.send_signal(signal.SIGTERM)
    ready = requests.get(f"{server.url}/ready", timeout=10)
    assert ready.status_code == 503
    assert ready.json() == {"status": "draining"}
    refused = requests.post(
        f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    assert int(refused.headers["Retry-After"]) >= 1
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200  # loop alive

    for iterator in iterators:
        events = read_events(iterator)
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length"
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] == len("drain me") + 1
    assert server.proc.wait(timeout=120) == 0
    log = server.log.read_text()
    assert f"draining: {NUM_STREAMS} sequences in flight" in log
    assert "(all requests finished)" in log


def test_drain_timeout_aborts_what_is_left_and_still_exits_0(impatient_server: Server) -> None:
    server = impatient_server
    # Thousands of tokens: far more than one second of work.
    stream = open_stream(server, LONG_CONTEXT - 16)
    lines = stream.iter_lines()
    assert next(lines).startswith(b"data: {")
    server.proc.send_signal(signal.SIGTERM)
    events = read_events(lines)
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "abort"
    assert 0 < events[-1]["usage"]["completion_tokens"] < LONG_CONTEXT - 16
    assert server.proc.wait(timeout=60) == 0
    assert "some requests were aborted" in server.log.read_text()


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = engine_pythonpath()
    argv = [sys.executable, "-m", "pagekeeper_engine.cli", *args]
    return subprocess.run(
        argv, check=False, capture_output=True, text=True, env=env, timeout=timeout_s
    )


def test_bad_flags_exit_2_naming_the_flag() -> None:
    result = run_cli("serve", "/nowhere", "--block-size", "12")
    assert result.returncode == 2
    assert "--block-size" in result.stderr
    result = run_cli("serve", "/nowhere", "--gpu-memory-utilization", "1.5")
    assert result.returncode == 2
    assert "--gpu-memory-utilization" in result.stderr
    result = run_cli("launch")
    assert result.returncode == 2
    assert "usage: pagekeeper-engine serve MODEL" in result.stderr


def test_a_model_that_cannot_load_exits_1_naming_the_file(tmp_path: Path) -> None:
    result = run_cli(
        "serve", str(tmp_path), "--device", "cpu", "--host", "127.0.0.1",
        "--port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 1
    assert f"could not load {tmp_path}" in result.stderr
    assert str(tmp_path / "tokenizer.json") in result.stderr
