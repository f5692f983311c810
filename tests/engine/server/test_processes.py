"""The engine's processes: the core's death ends the server with exit 1, the front end's death
ends the core, and several front ends share one port and one /metrics view, and drain together."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import requests
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server, start_server

EXIT_TIMEOUT_S = 30.0  # each process notices within a second; the rest is interpreter exit
CORE_READY = re.compile(r"engine core \(pid (\d+)\) ready")


def core_pid(server: Server) -> int:
    match = CORE_READY.search(server.log.read_text(errors="replace"))
    assert match is not None, server.log_tail()
    return int(match.group(1))


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent to reap it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def wait_gone(pid: int, timeout_s: float = EXIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after {timeout_s} s"
        time.sleep(0.1)


def complete(server: Server, max_tokens: int = 4) -> str:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=max_tokens, temperature=0
    )
    return response.choices[0].text


def test_the_core_dying_fails_health_and_the_server_exits_1(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    server = start_server(checkpoint.path, tmp_path)
    try:
        complete(server)
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    assert "the engine core exited with code -9" in log, log[-3000:]


def test_the_front_end_dying_ends_the_core(checkpoint: Checkpoint, tmp_path: Path) -> None:
    server = start_server(checkpoint.path, tmp_path)
    pid = core_pid(server)
    try:
        complete(server)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=EXIT_TIMEOUT_S)
        wait_gone(pid)
    finally:
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)
        server.stop()


def counts(server: Server) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:e2e_request_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    return sample.value
    raise AssertionError("no e2e latency histogram in /metrics")


def test_two_front_ends_share_the_port_the_metrics_and_the_drain(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    server = start_server(checkpoint.path, tmp_path, "--api-server-count", "2")
    pid = core_pid(server)
    children = [
        pid
        for pid in subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(server.proc.pid)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        # multiprocessing's own helper (its resource tracker) is not one of the server's
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    try:
        assert len(children) == 2, children  # the core and the second front end
        num_requests = 12
        texts = {complete(server) for _ in range(num_requests)}
        assert len(texts) == 1  # greedy: whichever front end answered, the same text
        # Each scrape may land on either front end; every one sums both front ends' histograms.
        assert {counts(server) for _ in range(6)} == {float(num_requests)}
        assert server.stop() == 0
        for child in children:
            wait_gone(int(child))
        assert not is_running(pid)
    finally:
        server.stop()
