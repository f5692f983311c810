"""Session set-up: Triton's interpreter without a GPU, and the control-plane fixtures.

The control-plane helpers are imported inside the fixtures, so suites that never ask for a
cluster (the GPU and kernel tests on the device machine) do not need the kubernetes client.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test
# module imports a kernel, in whatever order the suites are collected: without a GPU, kernels
# run in Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from harness.cluster import Cluster

HERE = Path(__file__).parent
# What `make test` builds in the background (hack/jobs.sh) is needed only by these; they run
# last, so the rest of the suite overlaps the builds instead of waiting for them. Under
# pytest-xdist each group runs on one worker: the images share one build and podman's ports
# on the host network, and the Argo CD tests one binary that a changed script rebuilds.
BUILT_IN_BACKGROUND = {
    HERE / "images": "images",
    HERE / "gitops": "argocd",
    HERE / "integration" / "test_gitops_states.py": "argocd",
}


def _background_build(item: pytest.Item) -> str | None:
    path = Path(str(item.fspath))
    for where, group in BUILT_IN_BACKGROUND.items():
        if path == where or where in path.parents:
            return group
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = _background_build(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _background_build(item) is not None)  # stable sort


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """One real control plane for the whole test session; torn down at the end."""
    from harness.cluster import start_cluster  # noqa: PLC0415 (see module docstring)

    yield from start_cluster()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
