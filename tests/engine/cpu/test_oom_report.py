"""The termination-message contract: what the engine writes is what the operator classifies."""

from __future__ import annotations

from pathlib import Path

from pagekeeper_engine.memory.oom import termination_message, write_termination_log
from pagekeeper_operator.policy.adaptive import classify_termination


def test_runtime_gpu_oom_round_trips_to_a_step_down_classification() -> None:
    text = termination_message("gpu", "runtime", "step of 65536 tokens failed\n3 times")
    assert text == (
        "pagekeeper-oom kind=gpu phase=runtime detail=step of 65536 tokens failed 3 times\n"
    )
    classified = classify_termination("Error", text)
    assert classified is not None
    assert classified.label == "gpu-runtime"
    assert classified.can_step_down


def test_startup_oom_is_reported_but_does_not_step_down(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    assert write_termination_log("gpu", "startup", "KV cache holds 3 blocks", path=log)
    classified = classify_termination("Error", log.read_text())
    assert classified is not None
    assert classified.label == "gpu-startup"
    assert not classified.can_step_down


def test_message_fits_the_kubelet_limit_and_unwritable_path_is_reported(tmp_path: Path) -> None:
    assert len(termination_message("host", "runtime", "x" * 10_000).encode()) == 4096
    assert not write_termination_log("gpu", "runtime", "d", path=tmp_path / "no" / "such" / "f")
