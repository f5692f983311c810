"""Kill the operator at every named fault point, restart it, and check that the action resumed
from what the cluster holds (docs/crash-consistency.md).

Each case: a fresh namespace and server, the operator started with
`PAGEKEEPER_FAULT_POINT=<point>:<nth>`, the scenario driven until the operator SIGKILLed itself
there, the operator started again without it, then within CONVERGE_TIMEOUT status and objects
must match the truth, and the invariants hold: never fewer pods serving than the replicas less
maxUnavailable; no pod evicted twice, none for an alert already acted on; every canary with an
outcome; every history entry once; no orphaned object.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver, restrict_namespace
from pagekeeper_operator.faultpoints import FaultPoint
from tests.crash.harness import CONVERGE_TIMEOUT, Operator, pod_watch, timed
from tests.crash.scenarios import NAME, SCENARIOS, Run, scenario_for, settled
from tests.integration import operator_fixture

llmserver_crd = operator_fixture.llmserver_crd
SEEDS = (0, 1, 2)
RESULTS_ENV = "PAGEKEEPER_CRASH_RESULTS"
# Each point runs with seed 0 in `make test`; the other seeds in `make test-crash`.
CASES = [
    pytest.param(point, seed, marks=[pytest.mark.crash_full] if seed else [], id=f"{point}-{seed}")
    for scenario in SCENARIOS
    for point in scenario.points
    for seed in SEEDS
]


def record(point: FaultPoint, seed: int, outcome: str, seconds: float) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    line = {"point": str(point), "seed": seed, "outcome": outcome, "seconds": round(seconds, 1)}
    with Path(path).open("a", encoding="utf-8") as sink:
        sink.write(json.dumps(line) + "\n")


def test_every_point_has_a_scenario() -> None:
    assert sorted(p for s in SCENARIOS for p in s.points) == sorted(FaultPoint)


@pytest.mark.parametrize(("point", "seed"), CASES)
def test_the_operator_killed_at_a_point_resumes(
    cluster: Cluster,
    namespace: str,
    llmserver_crd: Path,
    tmp_path: Path,
    point: FaultPoint,
    seed: int,
) -> None:
    scenario = scenario_for(point)
    nth = scenario.nth(point, seed)
    restrict_namespace(cluster, namespace)
    with ExitStack() as stack:
        operator = Operator(cluster, namespace, tmp_path, scenario.env(stack, tmp_path))
        stack.callback(operator.stop)
        operator.start(fault=f"{point}:{nth}")
        cluster.apply_yaml({**llmserver(NAME, scenario.spec(seed)), "metadata": {
            "name": NAME, "namespace": namespace}})  # fmt: skip
        watch = stack.enter_context(pod_watch(cluster, namespace))
        run = Run(cluster, namespace, operator, watch, stack, seed)
        replicas = scenario.spec(seed)["replicas"]
        wait_for(lambda: settled(run, replicas), timeout=120, what=f"{NAME} Ready")
        try:
            scenario.trigger(run)
            operator.wait_killed_at(point, nth)
            operator.start()
            _, seconds = timed(
                lambda: scenario.converged(run), CONVERGE_TIMEOUT, f"convergence after {point}"
            )
            outcome = scenario.check(run)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{operator.logs()}") from exc
    record(point, seed, outcome, seconds)
