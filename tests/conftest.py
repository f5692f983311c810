"""Session fixtures shared by the integration and end-to-end suites.

The control-plane helpers are imported inside the fixtures, so suites that never ask for a
cluster (the GPU and kernel tests on the device machine) do not need the kubernetes client.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.cluster import Cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """One real control plane for the whole test session; torn down at the end."""
    from tests.support.cluster import start_cluster  # noqa: PLC0415 (see module docstring)

    yield from start_cluster()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
