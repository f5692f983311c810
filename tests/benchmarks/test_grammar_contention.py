"""The grammar contention benchmark runs the engine's own grammar path: every case times each
step, every row takes a token its mask allows, and the interpreter's switch interval is the
caller's again afterwards (no figure is asserted: they are the machine's)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import grammar_contention as gc
from benchmarks.shapes import SHAPES
from benchmarks.structured import write_json_tokenizer
from pagekeeper_engine.runner import structured_output as so

ENGINE_MS = so.GRAMMAR_SWITCH_INTERVAL_S * 1e3  # the engine's switch interval, in ms


def test_each_case_times_every_step_and_the_interval_is_restored() -> None:
    before = sys.getswitchinterval()
    report = gc.main(["--rows", "4", "--steps", "3"])
    cases = [k for k in report if k not in ("shape", "rows", "steps")]
    assert cases == ["alone", "busy loop, 5 ms switch", f"busy loop, {ENGINE_MS:g} ms switch"]
    assert all(report[c]["median_ms"] > 0 and report[c]["p90_ms"] > 0 for c in cases)
    for case in cases:  # the hand-over, then the job's parts; every step's batch fill ran
        parts = report[case]["mean_parts_ms"]
        assert list(parts) == ["queue", "device_wait", "accept", "bitmask", "host_ops"]
        assert all(v >= 0 for v in parts.values()) and parts["bitmask"] > 0, (case, parts)
    distinct = report["alone"]["distinct_masks"]
    assert 1 <= distinct["median"] <= distinct["max"] <= 4  # four rows
    assert "distinct_masks" not in report["busy loop, 5 ms switch"]
    assert report["alone"]["fill_row_us"] > 0  # the engine's estimate, from one-thread fills
    assert sys.getswitchinterval() == before


def test_distinct_masks_count_rows_at_different_states(tmp_path: Path) -> None:
    config = SHAPES["qwen3-0.6b"]
    write_json_tokenizer(tmp_path, config)
    eos = config["eos_token_id"]
    grammar = so.GrammarMasks(
        tmp_path, config["vocab_size"], frozenset({eos}), 4, torch.device("cpu")
    )
    counts: list[int] = []
    interval = sys.getswitchinterval()  # the grammar's set-up lowers it
    try:
        gc.run_case(grammar, 4, 40, eos, busy=False, distinct=counts)
    finally:
        sys.setswitchinterval(interval)
    assert len(counts) == 40 and all(1 <= c <= 4 for c in counts)
    assert counts[0] == 1, "every row starts at the schema's first state"
    assert max(counts) > 1, "the rows' seeded picks part them inside the strings"


def test_more_switch_intervals_add_busy_cases_once_each() -> None:
    report = gc.main(["--rows", "4", "--steps", "3", "--switch-ms", f"{ENGINE_MS:g}", "0.2"])
    cases = [k for k in report if k not in ("shape", "rows", "steps")]
    assert cases == [
        "alone",
        "busy loop, 5 ms switch",
        f"busy loop, {ENGINE_MS:g} ms switch",  # the engine's, not repeated
        "busy loop, 0.2 ms switch",
    ]


def test_fill_threads_cases_time_the_job_and_its_batch_fill() -> None:
    before = sys.getswitchinterval()
    report = gc.main(["--rows", "4", "--steps", "3", "--fill-threads", "1", "2"])
    assert sys.getswitchinterval() == before
    assert_idle_cases(report, ["alone, fill on 1 threads", "alone, fill on 2 threads"])


def test_a_row_takes_a_token_its_mask_allows() -> None:
    words = torch.zeros(2, dtype=torch.int32)
    words[0] = (1 << 5) | (1 << 2)  # tokens 2 and 5
    picks = {gc.next_token(words, 64, random.Random(seed)) for seed in range(20)}
    assert picks == {2, 5}
    words[0] = 1 << 2
    assert gc.next_token(words, 64, random.Random(0)) == 2


def test_torch_threads_cases_run_each_pool_size_and_restore_the_callers() -> None:
    before = torch.get_num_threads()
    report = gc.main(["--rows", "4", "--steps", "3", "--torch-threads", "2", "1"])
    assert torch.get_num_threads() == before
    assert_idle_cases(report, ["alone, torch on 2 threads", "alone, torch on 1 threads"])


def assert_idle_cases(report: dict[str, Any], names: list[str]) -> None:
    """Exactly these cases, each timing the job and the batch fill inside it."""
    cases = [k for k in report if k not in ("shape", "rows", "steps")]
    assert cases == names
    for case in cases:
        job, fill = report[case]["job"], report[case]["batch_fill"]
        assert 0 < fill["median_ms"] <= job["p90_ms"], "the batch fill is inside the job"
