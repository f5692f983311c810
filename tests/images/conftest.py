"""The container images, built from this tree on the Debian bases and run with podman.

`make test` starts building them in the background before anything else (`hack/jobs.sh`); the
`images` fixture waits for that build and builds again, which takes seconds when nothing changed
and makes these tests runnable on their own.
Every test here is marked `integration`: they need the image tools (and, for the operator, the
local control plane), like the suites in `tests/integration/`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.images.podman import build_test_images, require_tools
from tests.support.jobs import wait_job

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Image id by Dockerfile target (`operator`, `engine`)."""
    wait_job("images")
    require_tools()
    return build_test_images(tmp_path_factory.mktemp("images") / "build.log")
