"""Torch's CPU threads in a process whose model runs on a GPU (`runner.host_threads`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from pagekeeper_engine.runner.host_threads import host_threads_for, limit_host_threads


def test_a_gpu_process_gets_one_thread_unless_the_environment_names_a_count() -> None:
    assert host_threads_for("cuda", {}) == 1
    assert host_threads_for("cuda", {"OMP_NUM_THREADS": ""}) == 1
    assert host_threads_for("cuda", {"OMP_NUM_THREADS": "4"}) is None
    assert host_threads_for("cpu", {}) is None  # the model's own matmuls use the pool


def test_limit_sets_torchs_pool_and_leaves_the_cpu_alone() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        limit_host_threads("cpu", {})
        assert torch.get_num_threads() == 2
        limit_host_threads("cuda", {"OMP_NUM_THREADS": "2"})
        assert torch.get_num_threads() == 2
        limit_host_threads("cuda", {})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_thread_started_after_the_limit_runs_on_one() -> None:
    """The grammar thread starts with the first structured request, after start-up: torch's
    ops on it (the bitmask rows' fill and reduction) take the limited pool too."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        limit_host_threads("cuda", {})
        with ThreadPoolExecutor(1) as later:
            assert later.submit(torch.get_num_threads).result() == 1
    finally:
        torch.set_num_threads(before)
