"""benchmarks/host_loop.py: the engine loop over a runner that answers at once still serves the
whole workload, every request to its max_tokens, in either scheduling mode, and says where its
steps went; `engine_probes.host_profile` names the loop's functions."""

from __future__ import annotations

import pytest

from benchmarks.engine_probes import host_profile
from benchmarks.host_loop import build_loop, run_pass
from benchmarks.offline_engine import Workload

PARTS = ["schedule", "launch", "book", "wait", "apply"]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_pass_serves_every_token_the_workload_asks_for(async_scheduling: bool) -> None:
    prompts = [[5] * n for n in (40, 17, 33, 90)]
    work = Workload(prompts, [12, 3, 30, 7])
    engine = build_loop(max_num_seqs=2, num_gpu_blocks=64, async_scheduling=async_scheduling)
    assert engine.is_async is async_scheduling
    first = run_pass(engine, work, "a")
    assert first.output_tokens == work.num_output_tokens == 52
    # two running at a time: the longest pair runs its 30 tokens one step each at least
    assert first.steps >= 30
    assert first.ms_per_step > 0 and first.us_per_token > 0
    again = run_pass(engine, work, "b")  # the same loop takes the workload again
    assert again.output_tokens == 52 and not engine.has_work()
    # the parts are intervals inside the pass, so together at most its time
    assert list(again.parts_ms) == PARTS
    assert all(ms >= 0 for ms in again.parts_ms.values())
    assert sum(again.parts_ms.values()) * again.steps <= again.seconds * 1e3
    assert (again.parts_ms["book"] > 0) is async_scheduling


def test_the_host_profile_names_the_loops_functions() -> None:
    work = Workload([[5] * 30, [6] * 20], [9, 4])
    engine = build_loop(max_num_seqs=2, num_gpu_blocks=64, async_scheduling=True)
    profile = host_profile(lambda: run_pass(engine, work, "p"), top=50)
    names = [row[0] for row in profile["by_total_time"]]
    assert any(name.startswith("scheduler.py:") and name.endswith("(schedule)") for name in names)
    own = [row[2] for row in profile["by_own_time"]]
    assert own == sorted(own, reverse=True) and len(own) == 50
    assert not engine.has_work()
