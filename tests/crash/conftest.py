"""The crash-consistency suite: the real operator killed (SIGKILL) at each named fault point of
its multi-step actions, on the real control plane with KWOK, restarted, and checked.

Every test here is marked `crash` and `integration`. `make test` runs each point with seed 0;
`make test-crash` (PAGEKEEPER_CRASH_FULL=1) runs every point with every seed and records each
case's outcome and time to converge in $PAGEKEEPER_CRASH_RESULTS (JSON lines) for
docs/crash-consistency.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FULL_ENV = "PAGEKEEPER_CRASH_FULL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    is_full = os.environ.get(FULL_ENV, "") == "1"
    kept, deselected = [], []
    for item in items:
        if HERE not in Path(str(item.fspath)).parents:
            kept.append(item)
            continue
        item.add_marker(pytest.mark.integration)
        item.add_marker(pytest.mark.crash)
        if not is_full and item.get_closest_marker("crash_full") is not None:
            deselected.append(item)
        else:
            kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
