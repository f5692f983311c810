"""The pod-age driver over remediation's real port and an in-memory API: the intent and the
outcome in the history, the Events (a wait and a refusal told once a pod), status.lifecycle,
and the cooldown an age's eviction starts for the next."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.controllers.pod_age_loop import PodAgeLoop
from pagekeeper_operator.remediation.actions import KubeClusterPort
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.rollout.pod_age import AgeVerdict, HoldReason
from tests.operator.servers import server_body

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=2)  # every pod past a 1h age


def pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name, "namespace": "ml", "uid": f"uid-{name}",
            "creationTimestamp": "2026-03-01T12:00:00Z",
            "labels": {"pagekeeper.dev/llmserver": "qwen"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "qwen-1", "controller": True}],
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


class FakeKube:
    """The API calls the driver and the port make, over objects in memory."""

    def __init__(self, spec: dict[str, Any], num_pods: int = 3) -> None:
        self.server = server_body(spec)
        self.server["status"] = {}
        self.pods = {f"qwen-{i}": pod(f"qwen-{i}") for i in range(num_pods)}
        generation = {"generation": 1}
        full = {"observedGeneration": 1, "replicas": num_pods}
        status = full | {"updatedReplicas": num_pods, "availableReplicas": num_pods}
        self.deployment = {"metadata": generation, "spec": {"replicas": num_pods}, "status": status}
        self.refusal: int | None = None
        self.evictions: list[str] = []
        self.events: list[tuple[str, str, str]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        return copy.deepcopy(self.server if kind == "LLMServer" else self.deployment)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> Any:
        return copy.deepcopy(list(self.pods.values()))

    def evict(self, namespace: str, name: str) -> None:
        self.evictions.append(name)
        if self.refusal is not None:
            raise ApiException(status=self.refusal, reason="Too Many Requests")
        self.pods[name]["metadata"]["deletionTimestamp"] = "2026-03-01T14:00:00Z"

    def create_event(self, body: dict[str, Any]) -> None:
        self.events.append((body["type"], body["reason"], body["message"]))

    def update_status(self, namespace: str, name: str, change: Any) -> Any:
        patch = change(copy.deepcopy(self.server))
        if patch is None:
            return None
        for key, value in patch.items():
            if value is None:
                self.server["status"].pop(key, None)
            else:
                self.server["status"][key] = value
        return self.server


SPEC = {"replicas": 3, "lifecycle": {"maxPodAge": "1h"}, "remediation": {"cooldownSeconds": 60}}


def driver(kube: FakeKube, clock: list[datetime]) -> PodAgeLoop:
    port = KubeClusterPort(kube)  # type: ignore[arg-type]
    return PodAgeLoop(port, Remediator(port), clock=lambda: clock[0])


def test_a_due_pod_is_evicted_with_its_record_event_and_status_then_the_cooldown_holds() -> None:
    kube, clock = FakeKube(SPEC), [NOW]
    loop = driver(kube, clock)
    decision = asyncio.run(loop.round("ml", "qwen"))
    assert decision is not None and decision.verdict is AgeVerdict.REPLACE
    assert decision.pod is not None
    evicted = decision.pod.name
    assert kube.evictions == [evicted]
    [record] = kube.server["status"]["remediationHistory"]
    assert (record["action"], record["outcome"], record["alert"], record["pod"]) == (
        "evict", "evicted", "MaxPodAge", evicted,
    )  # fmt: skip
    assert record["fingerprint"] == f"uid-{evicted}"
    prefix = f"MaxPodAge: evicted ml/{evicted}: {evicted} is 2h old, due since"
    assert record["message"].startswith(prefix)
    assert kube.server["status"]["lastRemediation"] == "2026-03-01T14:00:00Z"
    assert kube.events == [("Normal", "PodAgeReplaced", record["message"])]
    lifecycle = kube.server["status"]["lifecycle"]
    assert (lifecycle["lastReplacedPod"], lifecycle["lastReplacedAt"]) == (
        evicted, "2026-03-01T14:00:00Z",
    )  # fmt: skip
    assert lifecycle["oldestPodCreatedAt"] == "2026-03-01T12:00:00Z"

    # The evicted pod is gone and its replacement ready; the next due one waits the cooldown.
    del kube.pods[evicted]
    kube.pods["qwen-new"] = pod("qwen-new")
    kube.pods["qwen-new"]["metadata"]["creationTimestamp"] = "2026-03-01T14:00:05Z"
    clock[0] = NOW + timedelta(seconds=30)
    for _ in range(2):  # told once
        decision = asyncio.run(loop.round("ml", "qwen"))
        assert decision is not None and decision.reason is HoldReason.COOLDOWN
    assert kube.evictions == [evicted]
    assert [e[1] for e in kube.events] == ["PodAgeReplaced", "PodAgeReplacementWaiting"]
    lifecycle = kube.server["status"]["lifecycle"]
    assert lifecycle["reason"] == "cooldown"
    assert lifecycle["message"].endswith("waiting: cooldown until 2026-03-01T14:01:00Z")

    clock[0] = NOW + timedelta(seconds=60)
    decision = asyncio.run(loop.round("ml", "qwen"))
    assert decision is not None and decision.verdict is AgeVerdict.REPLACE
    assert len(kube.evictions) == 2 and kube.evictions[1] != evicted


def test_a_refused_eviction_is_recorded_once_and_retried() -> None:
    kube, clock = FakeKube(SPEC), [NOW]
    kube.refusal = 429
    loop = driver(kube, clock)
    for _ in range(3):
        decision = asyncio.run(loop.round("ml", "qwen"))
        assert decision is not None and decision.verdict is AgeVerdict.REPLACE
        clock[0] += timedelta(seconds=10)
    assert len(kube.evictions) == 3 and len(set(kube.evictions)) == 1
    [record] = kube.server["status"]["remediationHistory"]  # the later intents were dropped
    assert (record["outcome"], record["pod"]) == ("pdb-blocked", kube.evictions[0])
    assert [(e[0], e[1]) for e in kube.events] == [("Warning", "PodAgeEvictionBlocked")]
    lifecycle = kube.server["status"]["lifecycle"]
    assert (lifecycle["waitingPod"], lifecycle["reason"]) == (kube.evictions[0], "pdb-blocked")
    assert "lastReplacedPod" not in lifecycle


def test_status_lifecycle_goes_when_max_pod_age_is_unset() -> None:
    kube, clock = FakeKube({"replicas": 3}), [NOW]
    kube.server["status"]["lifecycle"] = {"message": "from before"}
    assert asyncio.run(driver(kube, clock).round("ml", "qwen")) is None
    assert "lifecycle" not in kube.server["status"]
    assert kube.evictions == []
