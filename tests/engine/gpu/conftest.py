"""GPU tests share one process and one device: each test's runners are released before the
next test starts, so that a runner kept alive by a reference cycle does not hold its KV cache
into the next test's start-up budget (which reads the device's free memory)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def released_device_memory() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
