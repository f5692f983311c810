"""Kernel tests run natively on a CUDA GPU, else in Triton's CPU interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, so it must be set before any
`pagekeeper_engine.kernels.*` module is imported: conftest.py is loaded before the test modules.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def generator(request: pytest.FixtureRequest, device: torch.device) -> torch.Generator:
    """Seeded from the test's id: inputs differ between test cases but rerun identically."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return gen
