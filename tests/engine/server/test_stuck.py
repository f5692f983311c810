"""A step that never returns, injected on one rank (`PAGEKEEPER_INJECT_STEP_HANG`), is found by
the progress watchdog within `--stuck-timeout`: the request in flight gets a 503 that says
`stuck`, the termination message is the `pagekeeper-stuck` line with the step's age and the
requests held, the worker ranks go with the core and the server exits 1. At one rank, and at
two over gloo with either rank hung (rank 0's loop stalls in the collective a hung worker
never joins)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from openai import APIStatusError, OpenAI

from pagekeeper_engine.faults import INJECT_STEP_HANG_ENV
from pagekeeper_engine.stuck import parse_stuck_message
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, start_server
from tests.engine.server.test_processes import is_running, wait_gone

STUCK_TIMEOUT_S = 2.0
# Bounds, not speeds: the timeout plus a generous margin for a busy 2-core machine.
FOUND_WITHIN_S = STUCK_TIMEOUT_S + 60.0
EXIT_TIMEOUT_S = 30.0


@pytest.mark.parametrize(("size", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_hung_step_is_found_and_ends_the_server(
    checkpoint: Checkpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    size: int,
    rank: int,
) -> None:
    monkeypatch.setenv(INJECT_STEP_HANG_ENV, f"{rank}:3")
    termination = tmp_path / "termination-log"
    server = start_server(
        checkpoint.path, tmp_path, "--tensor-parallel-size", str(size),
        "--stuck-timeout", str(STUCK_TIMEOUT_S), "--termination-log-path", str(termination),
    )  # fmt: skip
    workers = list(server.worker_pids(size).values())
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(APIStatusError) as failed:
            client.completions.create(
                model=MODEL_NAME,
                prompt="tell me",
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=FOUND_WITHIN_S,
            )
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
        for pid in workers:
            wait_gone(pid)
    finally:
        for pid in workers:
            if is_running(pid):
                os.kill(pid, 9)
        server.stop()
    log = server.log.read_text(errors="replace")
    report = parse_stuck_message(termination.read_text())
    assert report is not None, termination.read_text()
    assert (report.num_running, report.num_waiting) == (1, 0)
    assert STUCK_TIMEOUT_S <= report.last_step_age_s < FOUND_WITHIN_S
    assert report.detail == (
        f"the engine's step loop completed no step for {report.last_step_age_s:.1f} s with "
        "1 running and 0 waiting (--stuck-timeout 2)"
    )
    assert failed.value.status_code == 503, failed.value
    assert f"stuck: {report.detail}" in failed.value.message, failed.value
    assert f"the engine core gave up: stuck: {report.detail}\n" in log, log[-3000:]
    assert re.search(r"the step loop's thread is here:\n(.|\n)*in execute", log), log[-3000:]
