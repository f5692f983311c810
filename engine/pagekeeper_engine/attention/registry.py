"""Picks the attention backend for a device.

On CUDA the Triton backend (`attention/triton_backend.py`, class `TritonAttentionBackend`) is
used when that module is present; everywhere else, and on CUDA without it, the torch reference.
A Triton module that exists but fails to import is an error, not a silent fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from pagekeeper_engine.attention.base import AttentionBackend
from pagekeeper_engine.attention.torch_ref import TorchRefBackend

logger = logging.getLogger(__name__)

TRITON_MODULE = "pagekeeper_engine.attention.triton_backend"


def get_backend(device: str) -> AttentionBackend:
    """The attention backend for `device` ("cuda", "cuda:N" or "cpu")."""
    if device.startswith("cuda") and importlib.util.find_spec(TRITON_MODULE) is not None:
        module = importlib.import_module(TRITON_MODULE)
        backend: AttentionBackend = module.TritonAttentionBackend()
        logger.info("attention backend: %s", backend.name)
        return backend
    if device.startswith("cuda"):
        logger.warning("attention backend: torch reference on CUDA (no Triton backend installed)")
    return TorchRefBackend()
