"""A canary's outcome is in status before any Deployment moves, so an operator killed between
the two finishes the step from status (tests/crash runs the real kills)."""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.adapters.plan import ObjectKey
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import ReconcileResult, _post_event, reconcile
from pagekeeper_operator.render.meta import SERVER_LABEL
from tests.operator.servers import DEFAULT_IMAGES, merge, server_body
from tests.operator.test_reconcile_fit import MemoryKube

SPEC: dict[str, Any] = {
    "replicas": 3,
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 60}},
}
CHANGED = merge(SPEC, {"memoryPolicy": {"gpuMemoryUtilization": 0.85}})
MAIN: ObjectKey = ("apps/v1", "Deployment", "qwen")
CANARY: ObjectKey = ("apps/v1", "Deployment", "qwen-canary")


class RecordingKube(MemoryKube):
    """The in-memory cluster, with status writes and the order of every write recorded."""

    def __init__(self) -> None:
        super().__init__([])
        self.writes: list[tuple[str, Any]] = []
        self.canary_pods: list[dict[str, Any]] = []

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        return self.canary_pods if kind == "Pod" else []

    def apply(self, manifest: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        self.writes.append(("apply", manifest["metadata"]["name"]))
        return super().apply(manifest, **kwargs)

    def delete(self, key: ObjectKey, namespace: str, uid: str) -> None:
        self.writes.append(("delete", key[2]))
        super().delete(key, namespace, uid)

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any], *_: Any) -> bool:
        self.writes.append(("status", patch))
        return True


def canary_pod(terminated: dict[str, Any] | None = None) -> dict[str, Any]:
    last = {"terminated": terminated} if terminated else {}
    return {
        "metadata": {"name": "qwen-canary-1", "labels": {SERVER_LABEL: "qwen"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "engine", "restartCount": 0, "lastState": last}],
        },
    }


def reconcile_at(
    kube: RecordingKube, spec: dict[str, Any], status: dict[str, Any], now: str
) -> ReconcileResult:
    server = LLMServer.from_body(server_body(spec, status=status))
    return reconcile(kube, server, DEFAULT_IMAGES, now)  # type: ignore[arg-type]


def analyzing(kube: RecordingKube) -> dict[str, Any]:
    """A server whose canary started at 01:00 and runs beside two stable pods."""
    status = reconcile_at(kube, SPEC, {}, "2026-11-29T00:59:00Z").status_patch
    started = reconcile_at(kube, CHANGED, status, "2026-11-29T01:00:00Z")
    status = merge(status, started.status_patch)
    assert status["canary"]["phase"] == "Analyzing"
    assert CANARY in kube.objects
    kube.writes.clear()
    return status


def test_a_promotion_is_in_status_before_the_deployments_move() -> None:
    kube = RecordingKube()
    status = analyzing(kube)
    kube.canary_pods = [canary_pod()]
    result = reconcile_at(kube, CHANGED, status, "2026-11-29T01:02:00Z")

    assert result.error is None
    kind, patch = kube.writes[0]
    assert kind == "status" and patch["canary"]["phase"] == "Promoted", kube.writes
    assert ("apply", "qwen") in kube.writes[1:] and ("delete", "qwen-canary") in kube.writes[1:]


def test_a_failure_is_in_status_before_the_canary_pods_go() -> None:
    kube = RecordingKube()
    status = analyzing(kube)
    oom = {"reason": "OOMKilled", "finishedAt": "2026-11-29T01:01:00Z"}
    kube.canary_pods = [canary_pod(oom)]
    reconcile_at(kube, CHANGED, status, "2026-11-29T01:01:30Z")

    kind, patch = kube.writes[0]
    assert kind == "status" and patch["canary"]["phase"] == "Failed", kube.writes
    assert patch["canary"]["failedSignal"] == "oomEvents"
    assert ("delete", "qwen-canary") in kube.writes[1:]


def test_an_operator_killed_after_the_failure_was_recorded_takes_the_canary_back() -> None:
    """Status says Failed, the canary Deployment and the shrunk stable one are still there
    (killed before they moved), and the canary pod is clean now: the next reconcile finishes
    the rollback rather than analyzing again."""
    kube = RecordingKube()
    status = analyzing(kube)
    failed = merge(status, {"canary": {"phase": "Failed", "failedSignal": "oomEvents"}})
    kube.canary_pods = [canary_pod()]
    result = reconcile_at(kube, CHANGED, failed, "2026-11-29T03:00:00Z")

    assert CANARY not in kube.objects
    assert kube.objects[MAIN]["spec"]["replicas"] == 3
    assert "canary" not in result.status_patch  # the outcome stands


class EventKube:
    """Events by name, as the API server keeps them: a second create of one name is a 409."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.generated = 0

    def create_event(self, event: dict[str, Any]) -> None:
        name = event["metadata"].get("name")
        if name is None:
            self.generated += 1
            name = f"{event['metadata']['generateName']}{self.generated}"
        if name in self.events:
            raise ApiException(status=409, reason="AlreadyExists")
        self.events[name] = event


def test_an_event_of_one_transition_is_posted_once_however_many_reconciles_see_it() -> None:
    server = LLMServer.from_body(server_body(SPEC))
    kube = EventKube()
    for message in ("holding since 10:11:40", "holding since 10:11:43"):  # two racing reads
        _post_event(kube, server, "Warning", "CanaryNoData", message, "none|new|t|Analyzing")  # type: ignore[arg-type]
    [(name, posted)] = kube.events.items()
    assert name.startswith("qwen.") and posted["message"] == "holding since 10:11:40"
    _post_event(kube, server, "Warning", "CanaryNoData", "later", "t2|new|t|Analyzing")  # type: ignore[arg-type]
    # Without a key each Event is new (generateName), as for remediation's.
    _post_event(kube, server, "Normal", "PolicyFits", "fits")  # type: ignore[arg-type]
    _post_event(kube, server, "Normal", "PolicyFits", "fits")  # type: ignore[arg-type]
    assert len(kube.events) == 4
