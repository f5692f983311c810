"""A batch fill's thread count: one per THREAD_WORK_S of the rows' work on one thread, measured
from the fills that ran on one thread, with a one-thread fill every PROBE_EVERY fills."""

from __future__ import annotations

import pytest

from pagekeeper_engine.runner import fill_threads as ft
from pagekeeper_engine.runner.fill_threads import FillThreads, threads_for

WORK = ft.THREAD_WORK_S


@pytest.mark.parametrize(
    ("rows", "row_seconds", "max_threads", "threads"),
    [
        (64, 5e-6, 8, 1),  # the benchmark's schema: 0.32 ms of work
        (0, 1e-3, 8, 1),  # at least one
        (1, WORK, 8, 1),  # exactly one thread's work
        (2, WORK, 8, 2),
        (3, WORK, 8, 3),
        (256, 1e-4, 8, 8),  # 25.6 ms of work: the cap
        (256, 1e-4, 2, 2),
        (10, 0.0, 4, 1),
    ],
)
def test_threads_for_the_work(
    rows: int, row_seconds: float, max_threads: int, threads: int
) -> None:
    assert threads_for(rows, row_seconds, max_threads) == threads


def test_no_estimate_yet_fills_on_one_thread() -> None:
    threads = FillThreads(8)
    assert [threads.choose(1000) for _ in range(3)] == [1, 1, 1]
    assert threads.row_seconds is None


def test_costly_rows_get_threads_and_a_probe_every_probe_every_fills() -> None:
    threads = FillThreads(8)
    assert threads.choose(100) == 1  # the first: a probe
    threads.observe(1, 100, 0.1)  # 1 ms a row: 100 ms of work
    assert threads.row_seconds == pytest.approx(1e-3)
    chosen = [threads.choose(100) for _ in range(2 * ft.PROBE_EVERY)]
    ones = [i + 1 for i, n in enumerate(chosen) if n == 1]  # counted from the first choice
    assert ones == [ft.PROBE_EVERY, 2 * ft.PROBE_EVERY]
    assert set(chosen) == {1, 8}


def test_cheap_rows_stay_on_one_thread() -> None:
    threads = FillThreads(8)
    for _ in range(300):
        n = threads.choose(64)
        assert n == 1
        threads.observe(n, 64, 64 * 5e-6)
    assert threads.row_seconds == pytest.approx(5e-6)


def test_only_one_thread_fills_with_rows_move_the_estimate() -> None:
    threads = FillThreads(4)
    threads.observe(2, 10, 1.0)  # several threads: their start is in the time
    threads.observe(1, 0, 1.0)  # no rows
    assert threads.row_seconds is None
    threads.observe(1, 10, 10e-3)  # 1 ms a row
    threads.observe(1, 10, 20e-3)  # 2 ms a row: the newest weighs NEWEST_WEIGHT
    assert threads.row_seconds == pytest.approx(1e-3 + ft.NEWEST_WEIGHT * 1e-3)
    threads.observe(4, 10, 1.0)
    assert threads.row_seconds == pytest.approx(1e-3 + ft.NEWEST_WEIGHT * 1e-3)


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(AssertionError):
        FillThreads(0)
