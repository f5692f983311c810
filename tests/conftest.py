"""Session fixtures shared by the integration and end-to-end suites."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.cluster import Cluster, start_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """One real control plane for the whole test session; torn down at the end."""
    yield from start_cluster()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
