"""Torch's CPU thread pool in a process whose model runs on a GPU.

Such a process does only bookkeeping on its CPU: it schedules, packs small index tensors,
fills the grammar masks on its grammar thread. Torch still sizes its intra-op pool to every
core of the host (16 on an H100 host), and any host op over more than its grain (a step's
bitmask rows are 64 x 4,748 words) wakes the whole pool, whose threads then spin waiting for
more work, on the same cores as the grammar thread and the step loop. So once the model is
loaded (a real checkpoint's load may convert on the CPU), the pool is held to one thread,
unless the operator set `OMP_NUM_THREADS`, which torch has already honoured.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

THREADS_ENV = "OMP_NUM_THREADS"
GPU_HOST_THREADS = 1


def host_threads_for(device_type: str, env: Mapping[str, str]) -> int | None:
    """Torch's intra-op threads for a process whose model runs on `device_type`: one for a GPU,
    None (keep torch's own choice) on the CPU or where the environment names a count."""
    if device_type != "cuda" or env.get(THREADS_ENV, "").strip():
        return None
    return GPU_HOST_THREADS


def limit_host_threads(device_type: str, env: Mapping[str, str]) -> None:
    """Hold torch's intra-op pool to `host_threads_for`'s count, where it gives one."""
    threads = host_threads_for(device_type, env)
    if threads is None or torch.get_num_threads() == threads:
        return
    logger.info(
        "torch's CPU threads %d -> %d (the model runs on the GPU; set %s to choose)",
        torch.get_num_threads(), threads, THREADS_ENV,
    )  # fmt: skip
    torch.set_num_threads(threads)
