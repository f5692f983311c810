"""spec.lifecycle.maxPodAge on the real control plane with KWOK nodes and the operator running:
pods past a short age are evicted one at a time, at least the cooldown apart, each with an
Event, a remediation record and status.lifecycle; while a canary is under way none is, and
status says why."""

from __future__ import annotations

import itertools
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import Cluster, wait_for
from harness.loop import PodWatch, llmserver, server_events, server_pods, wait_beside_canary
from harness.operator_process import OperatorProcess
from pagekeeper_operator.api.lifecycle import BOUNDS_RULE, FORMAT_RULE
from tests.integration import operator_fixture
from tests.integration.operator_fixture import apply_server, get_server, wait_ready
from tests.integration.test_canary import canary_pods, changed, wait_analyzing, wait_resyncs

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

COOLDOWN_SECONDS = 15
SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "replicas": 3,
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxModelLen": 4096},
    "lifecycle": {"maxPodAge": "1m"},
    "remediation": {"cooldownSeconds": COOLDOWN_SECONDS},
}


@pytest.mark.parametrize(
    ("age", "rule"),
    [("1d", FORMAT_RULE), ("90", FORMAT_RULE), ("59s", BOUNDS_RULE), ("8761h", BOUNDS_RULE)],
)
def test_the_api_server_refuses_a_bad_age_naming_the_field(
    cluster: Cluster, namespace: str, llmserver_crd: Path, age: str, rule: dict[str, str]
) -> None:
    body = llmserver("bad", {**SPEC, "lifecycle": {"maxPodAge": age}})
    result = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False
    )
    assert result.returncode != 0
    assert "spec.lifecycle.maxPodAge: Invalid value" in result.stderr
    assert rule["message"] in result.stderr


def test_the_api_server_stores_a_good_age(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    apply_server(
        cluster, namespace, llmserver("good", {**SPEC, "lifecycle": {"maxPodAge": "1h30m"}})
    )
    assert get_server(cluster, namespace, "good")["spec"]["lifecycle"] == {"maxPodAge": "1h30m"}


def age_records(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    status = get_server(cluster, namespace, name).get("status") or {}
    return [r for r in status.get("remediationHistory", []) if r["alert"] == "MaxPodAge"]


def min_ready_after_settled(watch: PodWatch, num_pods: int) -> int:
    """The fewest pods Ready and not going away at any point of the watch after `num_pods`
    first were: one replacement at a time never goes below num_pods - 1."""
    ready: dict[str, bool] = {}
    fewest, has_settled = num_pods, False
    for kind, pod in list(watch.seen):
        conditions = (pod.status.conditions if pod.status else None) or []
        is_ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
        ready[pod.metadata.name] = (
            kind != "DELETED" and is_ready and pod.metadata.deletion_timestamp is None
        )
        count = sum(ready.values())
        has_settled = has_settled or count == num_pods
        if has_settled:
            fewest = min(fewest, count)
    return fewest


def stamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_old_pods_are_replaced_one_at_a_time_with_status_and_events(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    watch = PodWatch(cluster.kubeconfig, namespace).start()
    try:
        apply_server(cluster, namespace, llmserver("qwen", SPEC))
        wait_ready(cluster, namespace, "qwen", 3)
        originals = {p.metadata.name for p in server_pods(cluster, namespace, "qwen")}
        assert len(originals) == 3

        def all_replaced() -> list[dict[str, Any]] | None:
            records = age_records(cluster, namespace, "qwen")
            evicted = [r for r in records if r["outcome"] == "evicted"]
            return evicted if {r["pod"] for r in evicted} >= originals else None

        evicted = wait_for(all_replaced, timeout=240, interval=2, what="every pod replaced")
        wait_ready(cluster, namespace, "qwen", 3)
        watch.wait_seen(lambda w: all(w.was_deleted(p) for p in originals), "the evictions")
        assert watch.error is None
    finally:
        watch.stop()

    assert sorted(r["pod"] for r in evicted) == sorted(originals), evicted
    times = [stamp(r["time"]) for r in evicted]
    assert all(
        (later - earlier).total_seconds() >= COOLDOWN_SECONDS
        for earlier, later in itertools.pairwise(times)
    ), times
    for record in evicted:
        assert record["action"] == "evict"
        assert f"evicted {namespace}/{record['pod']}" in record["message"]
        assert "(maxPodAge 1m)" in record["message"]
    # One at a time: never fewer than two of the three Ready.
    assert min_ready_after_settled(watch, 3) == 2
    # The API server marked each as evicted through the Eviction API (a PDB could refuse).
    for pod in originals:
        assert watch.disruption_of(pod) is not None, pod

    events = [e for e in server_events(cluster, namespace, "qwen") if e.reason == "PodAgeReplaced"]
    assert sorted(e.message.split(": ")[1] for e in events) == sorted(
        f"evicted {namespace}/{pod}" for pod in originals
    )
    current = server_pods(cluster, namespace, "qwen")
    oldest = min(p.metadata.creation_timestamp for p in current)

    def lifecycle_of_current_pods() -> dict[str, Any] | None:
        lifecycle: dict[str, Any] = get_server(cluster, namespace, "qwen")["status"]["lifecycle"]
        return lifecycle if stamp(lifecycle["oldestPodCreatedAt"]) == oldest else None

    lifecycle = wait_for(lifecycle_of_current_pods, timeout=30, what="the oldest pod in status")
    assert lifecycle["lastReplacedPod"] == evicted[-1]["pod"]
    assert lifecycle["lastReplacedAt"] == evicted[-1]["time"]
    columns = cluster.kubectl("get", "llms", "qwen", "-n", namespace).stdout
    assert "OLDEST-POD" in columns.splitlines()[0], columns


def test_no_pod_is_replaced_during_a_canary(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {
        **SPEC,
        "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
    }
    apply_server(cluster, namespace, llmserver("qwen", spec))
    wait_ready(cluster, namespace, "qwen", 3)
    apply_server(cluster, namespace, llmserver("qwen", changed(spec, 0.85)))
    wait_analyzing(cluster, namespace, "qwen")
    [canary] = canary_pods(cluster, namespace, "qwen")
    stable = wait_beside_canary(cluster, namespace, "qwen", canary.metadata.name, 2)
    before = stable | {canary.metadata.name}

    def held() -> dict[str, Any] | None:
        status = get_server(cluster, namespace, "qwen").get("status") or {}
        lifecycle = status.get("lifecycle") or {}
        return lifecycle if lifecycle.get("reason") == "canary" else None

    lifecycle = wait_for(held, timeout=150, interval=2, what="a due pod held by the canary")
    assert lifecycle["waitingPod"] in stable
    assert lifecycle["message"].endswith("; waiting: a canary is under way")
    # Three more resync rounds (5 s each) outlast a round of the age loop (10 s): the pod stays
    # held, and none goes.
    wait_resyncs(operator, 3)
    assert held() is not None
    assert age_records(cluster, namespace, "qwen") == []
    assert {p.metadata.name for p in server_pods(cluster, namespace, "qwen")} == before
    waiting = [
        e
        for e in server_events(cluster, namespace, "qwen")
        if e.reason == "PodAgeReplacementWaiting"
    ]
    held_pods = [
        e.message.split(" is ")[0] for e in waiting if e.message.endswith("a canary is under way")
    ]
    # Told once a pod: the rounds after the first add no Event.
    assert lifecycle["waitingPod"] in held_pods
    assert len(held_pods) == len(set(held_pods)), held_pods
