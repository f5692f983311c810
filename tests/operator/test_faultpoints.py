"""The fault points: parsed from the environment, every one placed in the operator's code, and
one reached the nth time kills the process on the spot."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagekeeper_operator.faultpoints import (
    CANARY_POINTS,
    FAULT_POINT_ENV,
    ArmedPoint,
    FaultPoint,
    parse_fault_point,
)

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "pagekeeper_operator"


def test_a_point_parses_with_its_count() -> None:
    assert parse_fault_point("") is None
    assert parse_fault_point("remediation.evicted") == ArmedPoint(FaultPoint.REMEDIATION_EVICTED, 1)
    assert parse_fault_point(" canary.promotion-pruned:3 ") == ArmedPoint(
        FaultPoint.CANARY_PROMOTION_PRUNED, 3
    )


@pytest.mark.parametrize(
    "text", ["remediation.nowhere", "remediation.evicted:0", "stepdown.recorded:x"]
)
def test_a_bad_point_names_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=FAULT_POINT_ENV):
        parse_fault_point(text)


def test_every_point_is_placed_in_the_operator() -> None:
    """Each point is reached somewhere: by name outside `faultpoints`, or through the canary's
    table, whose stages the reconcile reaches."""
    sources = "\n".join(
        path.read_text() for path in OPERATOR.rglob("*.py") if path.name != "faultpoints.py"
    )
    named = set(re.findall(r"FaultPoint\.([A-Z_]+)", sources))
    stages = set(re.findall(r'reached_canary\([^)]*"(\w+)"\)', sources))
    via_canary = {point.name for (_, stage), point in CANARY_POINTS.items() if stage in stages}
    assert named.isdisjoint(via_canary)
    assert named | via_canary == {point.name for point in FaultPoint}
    assert len(FaultPoint) >= 20


def _reach_twice(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "from pagekeeper_operator.faultpoints import FaultPoint, reached\n"
        "for hit in (1, 2):\n"
        "    reached(FaultPoint.STEPDOWN_RECORDED)\n"
        "    print('survived', hit, flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(OPERATOR.parent), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_nth_hit_kills_the_process() -> None:
    done = _reach_twice({FAULT_POINT_ENV: "stepdown.recorded:2"})
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "survived 1\n"
    assert "pagekeeper fault point stepdown.recorded:2 reached: SIGKILL" in done.stderr


def test_unarmed_or_another_point_is_a_no_op() -> None:
    for env in ({}, {FAULT_POINT_ENV: "stepdown.classified"}):
        done = _reach_twice(env)
        assert (done.returncode, done.stdout) == (0, "survived 1\nsurvived 2\n")
