"""Session set-up: Triton's interpreter without a GPU, and the control-plane fixtures.

The control-plane helpers are imported inside the fixtures, so suites that never ask for a
cluster (the GPU and kernel tests on the device machine) do not need the kubernetes client.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test
# module imports a kernel, in whatever order the suites are collected: without a GPU, kernels
# run in Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
