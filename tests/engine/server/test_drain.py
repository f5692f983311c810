"""SIGTERM drains: readiness fails at once, new work gets 503, running streams finish, exit 0.

The engine's steps run behind a gate (`tests/support/step_gate.py`), so where each request
stands when SIGTERM arrives, and whether it can finish before the drain's deadline, is set by
the steps the test allows, never by how fast the machine steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness.processes import engine_pythonpath, free_port
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server, start_server
from tests.support import step_gate
from tests.support.step_gate import StepGate

NUM_STREAMS = 3
MAX_TOKENS = 32  # more than the one step the gate allows before SIGTERM
PROMPT = "drain me"
# A bound on conditions (a few turns of the core's loop and its stats), not a speed.
CONDITION_TIMEOUT_S = 60.0
# The drain's deadline is not what the first test measures: its streams finish once the gate
# opens, and the test's own timeouts bound that.
PATIENT_SHUTDOWN_TIMEOUT_S = 3600


def open_stream(server: Server, max_tokens: int) -> requests.Response:
    """A streamed completion, once its first event is ready (the response starts with it)."""
    body: dict[str, Any] = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
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


def metric(server: Server, name: str, **labels: str) -> float | None:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    return None


def wait_for_metric(server: Server, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + CONDITION_TIMEOUT_S
    while (seen := metric(server, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} is {seen}, not {value}"
        time.sleep(0.05)


def wait_for_log(server: Server, text: str) -> None:
    deadline = time.monotonic() + CONDITION_TIMEOUT_S
    while text not in server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{server.log_tail()}"
        time.sleep(0.05)


def start(checkpoint: Checkpoint, workdir: Path, shutdown_timeout_s: int) -> Server:
    return start_server(
        checkpoint.path, workdir, "--shutdown-timeout", str(shutdown_timeout_s),
        module=step_gate.MODULE,
    )  # fmt: skip


@pytest.fixture
def drain_server(checkpoint: Checkpoint, tmp_path: Path, gate: StepGate) -> Iterator[Server]:
    server = start(checkpoint, tmp_path, shutdown_timeout_s=PATIENT_SHUTDOWN_TIMEOUT_S)
    yield server
    gate.open()
    server.stop()  # only does something when the test failed before the process exited


@pytest.fixture
def impatient_server(checkpoint: Checkpoint, tmp_path: Path, gate: StepGate) -> Iterator[Server]:
    server = start(checkpoint, tmp_path, shutdown_timeout_s=1)
    yield server
    gate.open()
    server.stop()


def test_sigterm_during_streams_lets_them_finish(drain_server: Server, gate: StepGate) -> None:
    server = drain_server
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        opening = [pool.submit(open_stream, server, MAX_TOKENS) for _ in range(NUM_STREAMS)]
        # The shut gate holds every request in the core's queue until all of them are there;
        # then one step: each prompt's prefill, and its first token.
        wait_for_metric(server, "vllm:num_requests_waiting", NUM_STREAMS)
        gate.allow(1)
        streams = [future.result() for future in opening]
    iterators = [s.iter_lines() for s in streams]
    firsts = [next(it) for it in iterators]  # every stream has produced a token
    assert all(f.startswith(b"data: {") for f in firsts)
    # The gate allows no second step: every stream is still running at SIGTERM.

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

    gate.open()
    for iterator in iterators:
        events = read_events(iterator)
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length"
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] == len(PROMPT) + 1
    assert server.proc.wait(timeout=120) == 0
    log = server.log.read_text()
    assert f"draining: {NUM_STREAMS} sequences in flight" in log
    assert "(all requests finished)" in log


def test_drain_timeout_aborts_what_is_left_and_still_exits_0(
    impatient_server: Server, gate: StepGate
) -> None:
    server = impatient_server
    gate.allow(1)  # the prefill and its first token, then the request is held
    stream = open_stream(server, MAX_TOKENS)
    lines = stream.iter_lines()
    assert next(lines).startswith(b"data: {")
    server.proc.send_signal(signal.SIGTERM)
    # Held, the request cannot finish within the 1 s deadline: the drain aborts it, and the
    # core, which still turns, applies the abort. Its output comes with the next step, which
    # the gate then allows (the front end waits `FLUSH_TIMEOUT_S` for it).
    wait_for_metric(server, "vllm:request_success_total", 1, finished_reason="abort")
    gate.open()
    events = read_events(lines)
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "abort"
    assert events[-1]["usage"]["completion_tokens"] == 1  # the one step it was allowed
    assert server.proc.wait(timeout=60) == 0
    log = server.log.read_text()
    assert "drain timed out after 1.0 s; aborted 1 requests" in log
    assert "some requests were aborted" in log


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
