"""End-to-end tests: the whole alert -> roll loop on the real local control plane, with a real
Prometheus and Alertmanager and the engine on the CPU; every test here is marked `e2e`.

The `cluster` and `namespace` fixtures live in `tests/conftest.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
