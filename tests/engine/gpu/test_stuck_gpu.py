"""On a GPU, a step hung inside CUDA (the injected hang: a kernel that spins for good, and the
loop's wait for it) is found by the progress watchdog within `--stuck-timeout`, and the server
exits 1 with the `pagekeeper-stuck` message. Prints the detection time, for docs/engine.md:

    python -m pytest tests/engine/gpu/test_stuck_gpu.py -m gpu -s
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from openai import APIStatusError, OpenAI

from pagekeeper_engine.faults import INJECT_STEP_HANG_ENV
from pagekeeper_engine.stuck import parse_stuck_message
from tests.engine.server.checkpoint import write_checkpoint
from tests.engine.server.conftest import MODEL_NAME, start_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STUCK_TIMEOUT_S = 2.0
# Bounds, not speeds: the timeout plus a generous margin.
FOUND_WITHIN_S = STUCK_TIMEOUT_S + 30.0
EXIT_TIMEOUT_S = 30.0


def test_a_step_hung_in_cuda_is_found_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "tiny-llama"
    write_checkpoint(checkpoint)
    monkeypatch.setenv(INJECT_STEP_HANG_ENV, "0:3")
    termination = tmp_path / "termination-log"
    server = start_server(
        checkpoint, tmp_path, "--device", "cuda", "--dtype", "bfloat16",
        "--stuck-timeout", str(STUCK_TIMEOUT_S), "--termination-log-path", str(termination),
    )  # fmt: skip
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        sent_s = time.monotonic()
        with pytest.raises(APIStatusError) as failed:
            client.completions.create(
                model=MODEL_NAME,
                prompt="tell me",
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=FOUND_WITHIN_S,
            )
        failed_s = time.monotonic() - sent_s
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
        exited_s = time.monotonic() - sent_s
    finally:
        server.stop()
    report = parse_stuck_message(termination.read_text())
    assert report is not None, termination.read_text()
    assert failed.value.status_code == 503, failed.value
    assert (report.num_running, report.num_waiting) == (1, 0)
    assert STUCK_TIMEOUT_S <= report.last_step_age_s < FOUND_WITHIN_S
    print(
        f"\nstuck engine at TP 1 on {torch.cuda.get_device_name()}: found with the hung step "
        f"{report.last_step_age_s:.1f} s old (--stuck-timeout {STUCK_TIMEOUT_S:g}); the request "
        f"failed {failed_s:.2f} s and the server exited {exited_s:.2f} s after it was sent"
    )
