"""Integration tests run against the real local control plane.

The `cluster` (session) and `namespace` (per test) fixtures live in `tests/conftest.py`, shared
with the end-to-end suite; every test in this folder is marked `integration`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
