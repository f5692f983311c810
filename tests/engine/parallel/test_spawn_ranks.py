"""The rank harness fails as soon as a rank dies, instead of waiting out its result timeout: a
rank that raises leaves its peers and the parent waiting for a result that never comes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.parallel.ranks import spawn_ranks


def _rank_one_fails(rank: int, size: int, port: int, results: Any) -> None:
    if rank == 1:
        raise SystemExit(3)


def _each_rank_reports(rank: int, size: int, port: int, results: Any) -> None:
    results.put((rank, size))


def test_a_rank_that_dies_fails_the_wait_at_once() -> None:
    # The timeout is far beyond the test's run: only the dead rank can end the wait.
    with pytest.raises(AssertionError, match="exited with 3 before the ranks' results"):
        spawn_ranks(_rank_one_fails, 2, (), 1, timeout=3600.0)


def test_results_come_back_from_every_rank() -> None:
    assert sorted(spawn_ranks(_each_rank_reports, 2, (), 2, timeout=3600.0)) == [(0, 2), (1, 2)]
