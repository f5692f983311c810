"""`--api-server-count auto`: front ends from the CPUs a process may use (its affinity and a
cgroup CPU limit), after one CPU per engine process; an explicit count as given, bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagekeeper_engine.config import (
    MAX_AUTO_API_SERVERS,
    choose_api_server_count,
    cpu_quota,
    parse_args,
    usable_cpus,
)


@pytest.mark.parametrize(
    ("num_cpus", "tp", "expected"),
    [(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1), (5, 1, 2), (8, 1, 3), (16, 1, 4), (128, 1, 4),
     (8, 4, 2), (9, 8, 1)],
)  # fmt: skip
def test_auto_count_leaves_a_cpu_per_engine_process(num_cpus: int, tp: int, expected: int) -> None:
    assert choose_api_server_count(num_cpus, tp) == expected
    assert MAX_AUTO_API_SERVERS == 4


@pytest.mark.parametrize(
    ("line", "expected"),
    [("max 100000\n", None), ("400000 100000\n", 4.0), ("150000 100000", 1.5), ("max", None)],
)
def test_cgroup_cpu_max_lines(line: str, expected: float | None) -> None:
    assert cpu_quota(line) == expected


def test_a_cpu_limit_bounds_the_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    limited = tmp_path / "cpu.max"
    limited.write_text("150000 100000\n")  # 1.5 CPUs: rounded up to 2
    assert usable_cpus(str(limited)) == min(affinity, 2)
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max 100000\n")
    assert usable_cpus(str(unlimited)) == affinity
    assert usable_cpus(str(tmp_path / "missing")) == affinity
    garbled = tmp_path / "garbled"
    garbled.write_text("lots 100000\n")
    assert usable_cpus(str(garbled)) == affinity


def test_parse_resolves_auto_and_keeps_an_explicit_count() -> None:
    expected = choose_api_server_count(usable_cpus(), 2)
    auto = parse_args(["/m", "--tensor-parallel-size", "2"])
    assert auto.api_server_count == expected
    explicit = parse_args(["/m", "--api-server-count", "auto"])
    assert explicit.api_server_count == choose_api_server_count(usable_cpus(), 1)
    assert parse_args(["/m", "--api-server-count", "3"]).api_server_count == 3


@pytest.mark.parametrize("value", ["0", "65", "two", "-1"])
def test_a_bad_count_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["/m", "--api-server-count", value])
    assert exited.value.code == 2
    assert "argument --api-server-count" in capsys.readouterr().err
