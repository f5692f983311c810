"""The stuck termination-message contract: what the paged engine's watchdog and the vLLM
launcher write is one line that `STUCK_LINE` (the regex the operator mirrors) parses back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagekeeper_engine.progress_watch import LoopProgress, find_stuck
from pagekeeper_engine.stuck import (
    STUCK_LINE,
    StuckReport,
    parse_stuck_message,
    write_stuck_message,
)
from pagekeeper_vllm.stall import StallTracker, VllmProgress

# The operator's copy of the format, spelled out here so a change to `STUCK_LINE` fails a test.
OPERATOR_PATTERN = (
    r"^pagekeeper-stuck last_step_age_s=(?P<age>\d+(?:\.\d+)?) running=(?P<running>\d+) "
    r"waiting=(?P<waiting>\d+) detail=(?P<detail>.*)$"
)


def test_the_paged_engine_writes_the_line() -> None:
    report = find_stuck(LoopProgress(10.0, 3, 5), now_s=72.25, timeout_s=60.0)
    assert report is not None
    assert report.message() == (
        "pagekeeper-stuck last_step_age_s=62.2 running=3 waiting=5 detail=the engine's step "
        "loop completed no step for 62.2 s with 3 running and 5 waiting (--stuck-timeout 60)\n"
    )
    parsed = parse_stuck_message(report.message())
    assert parsed is not None and parsed.message() == report.message()
    assert (parsed.last_step_age_s, parsed.num_running, parsed.num_waiting) == (62.2, 3, 5)


def test_the_vllm_launcher_writes_the_line() -> None:
    tracker = StallTracker(60.0, now_s=0.0)
    tracker.saw_health(61.0, is_healthy=True)
    tracker.saw_progress(1.0, VllmProgress(2, 0, 100.0))
    tracker.saw_progress(61.0, VllmProgress(2, 0, 100.0))
    report = tracker.check(61.5)
    assert report is not None
    assert report.message() == (
        "pagekeeper-stuck last_step_age_s=60.5 running=2 waiting=0 detail=vLLM counted no new "
        "token for 60.5 s with 2 running and 0 waiting (--stuck-timeout 60)\n"
    )
    parsed = parse_stuck_message(report.message())
    assert parsed is not None and parsed.message() == report.message()


def test_the_operators_pattern_is_the_engines() -> None:
    assert STUCK_LINE.pattern == OPERATOR_PATTERN
    line = StuckReport(2.0, 1, 0, "a\nb  c").message()
    match = re.match(OPERATOR_PATTERN, line.strip())
    assert match is not None
    assert match.groupdict() == {"age": "2.0", "running": "1", "waiting": "0", "detail": "a b c"}


@pytest.mark.parametrize(
    "text",
    [
        "pagekeeper-oom kind=gpu phase=runtime detail=x",
        "engine core failed: stuck",
        "pagekeeper-stuck last_step_age_s=2 running=x waiting=0 detail=",
    ],
)
def test_other_messages_are_not_stuck(text: str) -> None:
    assert parse_stuck_message(text) is None


def test_the_message_fits_the_kubelet_limit_and_is_written(tmp_path: Path) -> None:
    long = StuckReport(1.0, 0, 0, "x" * 10_000)
    assert len(long.message().encode()) == 4096
    log = tmp_path / "termination-log"
    assert write_stuck_message(StuckReport(3.04, 1, 2, "d"), log)
    assert log.read_text() == "pagekeeper-stuck last_step_age_s=3.0 running=1 waiting=2 detail=d\n"
    assert not write_stuck_message(long, tmp_path / "no" / "such" / "file")
