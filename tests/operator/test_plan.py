"""Planning (what to apply) and status computation, without a cluster."""

from __future__ import annotations

import copy
from typing import Any

from pagekeeper_operator.adapters.plan import (
    APPLIED_HASH_ANNOTATION,
    Delete,
    is_subset,
    key_of,
    plan,
    prune,
    stamp,
)
from pagekeeper_operator.controllers.refresh import refresh_status
from pagekeeper_operator.render import ClusterFeatures, render_all
from pagekeeper_operator.status.conditions import compute_status
from pagekeeper_operator.status.patch import merge_patch, status_patch
from pagekeeper_operator.timestamps import parse_time
from tests.operator.servers import DEFAULT_IMAGES, make_server

NOW = "2025-01-02T03:04:05Z"


def _desired() -> list[dict[str, Any]]:
    return render_all(make_server(), DEFAULT_IMAGES, ClusterFeatures())


def _as_stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns after our apply: defaults and other managers' fields added."""
    stored = copy.deepcopy(stamp(manifest))
    stored["metadata"].update(
        resourceVersion="42",
        uid="child-uid",
        generation=1,
        managedFields=[{"manager": "pagekeeper-operator"}],
    )
    stored["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    if manifest["kind"] == "Deployment":
        pod = stored["spec"]["template"]["spec"]
        pod["dnsPolicy"] = "ClusterFirst"
        container = pod["containers"][0]
        container["imagePullPolicy"] = "IfNotPresent"
        container["terminationMessagePath"] = "/dev/termination-log"
        # the server (or another manager) may order associative lists differently
        container["env"] = list(reversed(container["env"]))
        container["env"].append({"name": "INJECTED_BY_WEBHOOK", "value": "1"})
        pod["containers"].append({"name": "sidecar", "image": "proxy:1"})
        stored["status"] = {"replicas": 1}
    if manifest["kind"] == "Service":
        stored["spec"]["clusterIP"] = "10.0.0.7"
        stored["spec"]["ports"][0]["targetPort"] = "http"
    return stored


def _observed(desired: list[dict[str, Any]]) -> dict[Any, Any]:
    return {key_of(m): _as_stored(m) for m in desired}


def test_nothing_to_do_when_observed_matches() -> None:
    desired = _desired()
    assert plan(desired, _observed(desired)) == []


def test_missing_objects_are_applied_stamped() -> None:
    desired = _desired()
    actions = plan(desired, {})
    assert [(a.manifest["kind"], a.reason) for a in actions] == [
        ("Service", "missing"),
        ("PodDisruptionBudget", "missing"),
        ("Deployment", "missing"),
    ]
    annotations = actions[0].manifest["metadata"]["annotations"]
    assert (
        list(annotations) == [APPLIED_HASH_ANNOTATION]
        and len(annotations[APPLIED_HASH_ANNOTATION]) == 16
    )
    assert "annotations" not in desired[0]["metadata"], "plan must not mutate its input"


def test_a_spec_change_plans_only_the_objects_it_changes() -> None:
    observed = _observed(_desired())
    scaled = render_all(make_server({"replicas": 3}), DEFAULT_IMAGES, ClusterFeatures())
    actions = plan(scaled, observed)
    assert [(a.manifest["kind"], a.reason) for a in actions] == [("Deployment", "changed")]
    assert actions[0].manifest["spec"]["replicas"] == 3


def test_dropping_a_field_we_set_is_a_change() -> None:
    with_selector = render_all(
        make_server({"podTemplate": {"nodeSelector": {"pool": "a"}}}),
        DEFAULT_IMAGES,
        ClusterFeatures(),
    )
    observed = _observed(with_selector)
    actions = plan(_desired(), observed)  # desired is a subset of observed, yet it changed
    assert [(a.manifest["kind"], a.reason) for a in actions] == [("Deployment", "changed")]


def test_drift_in_a_field_we_own_is_repaired() -> None:
    desired = _desired()
    observed = _observed(desired)
    deployment = observed[key_of(desired[2])]
    deployment["spec"]["template"]["spec"]["containers"][0]["command"][4] = "9999"
    actions = plan(desired, observed)
    assert [(a.manifest["kind"], a.reason) for a in actions] == [("Deployment", "drifted")]


def test_drift_in_fields_we_do_not_own_is_ignored() -> None:
    desired = _desired()
    observed = _observed(desired)
    observed[key_of(desired[0])]["metadata"]["labels"]["team"] = "search"
    observed[key_of(desired[0])]["spec"]["sessionAffinity"] = "ClientIP"
    assert plan(desired, observed) == []


def test_quantities_compare_by_value_only_where_they_are_quantities() -> None:
    want = {"resources": {"limits": {"memory": "1024Mi", "cpu": "1"}}, "name": "1k"}
    assert is_subset(
        want, {"resources": {"limits": {"memory": "1Gi", "cpu": "1000m"}}, "name": "1k"}
    )
    assert not is_subset(
        want, {"resources": {"limits": {"memory": "1Gi", "cpu": "2"}}, "name": "1k"}
    )
    assert not is_subset({"name": "1k"}, {"name": "1000"})
    assert is_subset({"sizeLimit": "2Gi"}, {"sizeLimit": "2048Mi"})


def test_atomic_lists_must_match_exactly() -> None:
    assert is_subset({"command": ["a", "b"]}, {"command": ["a", "b"]})
    assert not is_subset({"command": ["a", "b"]}, {"command": ["a", "b", "c"]})
    assert not is_subset({"command": ["a", "b"]}, {"command": ["b", "a"]})
    assert not is_subset({"x": True}, {"x": 1})


def test_prune_deletes_only_what_the_server_controls() -> None:
    pdb = ("policy/v1", "PodDisruptionBudget", "qwen")
    ours = {
        "metadata": {
            "name": "qwen",
            "uid": "pdb-uid",
            "ownerReferences": [{"kind": "LLMServer", "uid": "uid-1", "controller": True}],
        }
    }
    assert prune([pdb], {pdb: ours}, "uid-1") == [Delete(key=pdb, uid="pdb-uid")]
    assert prune([pdb], {pdb: None}, "uid-1") == []
    # A user's budget of the same name, or one another server controls, stays.
    users = {"metadata": {"name": "qwen", "uid": "user-uid"}}
    assert prune([pdb], {pdb: users}, "uid-1") == []
    assert prune([pdb], {pdb: ours}, "uid-2") == []
    referenced = copy.deepcopy(ours)
    referenced["metadata"]["ownerReferences"][0]["controller"] = False
    assert prune([pdb], {pdb: referenced}, "uid-1") == []


def _deployment_status(
    ready: int,
    updated: int,
    total: int,
    generation: int = 2,
    observed: int = 2,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions or [],
        },
    }


def _conditions(status: Any) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_status_ready_and_rolled_out() -> None:
    server = make_server({"replicas": 2})
    status = compute_status(server, _deployment_status(2, 2, 2), NOW)
    assert _conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
        "MemoryHealthy": ("True", "NoMemoryEvents"),
        "Reconciling": ("False", "Idle"),
        "Stalled": ("False", "AsExpected"),
    }
    assert (status.replicas, status.ready_replicas, status.updated_replicas) == (2, 2, 2)
    assert status.observed_generation == 3
    assert (
        status.selector == "app.kubernetes.io/name=pagekeeper-engine,pagekeeper.dev/llmserver=qwen"
    )
    # The spec leaves the utilization unset: status spells out the 0.9 in force.
    assert status.effective_memory_policy == server.spec.memory_policy.model_copy(
        update={"gpu_memory_utilization": 0.9}
    )
    assert all(
        c.last_transition_time == parse_time(NOW) and c.observed_generation == 3
        for c in status.conditions
    )


def test_status_while_rolling_and_when_stuck() -> None:
    server = make_server({"replicas": 2})
    rolling = compute_status(server, _deployment_status(1, 1, 2), NOW)
    assert _conditions(rolling)["Ready"] == ("False", "ReplicasNotReady")
    assert _conditions(rolling)["Progressing"] == ("True", "RollingOut")
    stuck = compute_status(
        server,
        _deployment_status(
            1,
            1,
            2,
            conditions=[
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "too slow",
                }
            ],
        ),
        NOW,
    )
    assert _conditions(stuck)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    unobserved = compute_status(server, _deployment_status(2, 2, 2, generation=3), NOW)
    assert _conditions(unobserved)["Progressing"] == ("True", "RollingOut")
    failed = compute_status(server, None, NOW, apply_error="applying Deployment/qwen failed")
    assert _conditions(failed)["Degraded"] == ("True", "ApplyFailed")


def test_status_keeps_transition_times_and_remediation_fields() -> None:
    server = make_server({"replicas": 1})
    first = compute_status(server, _deployment_status(1, 1, 1), NOW)
    memory = {
        "type": "MemoryHealthy",
        "status": "False",
        "reason": "RuntimeGPUOOM",
        "message": "stepped down",
        "lastTransitionTime": NOW,
    }
    stored = {
        **first.to_api(),
        "lastRemediation": NOW,
        "conditions": [c for c in first.to_api()["conditions"] if c["type"] != "MemoryHealthy"]
        + [memory],
    }
    again = make_server({"replicas": 1}, status=stored)
    # Within spec.remediation.memoryHealthyAfterSeconds (default 3600) of the OOM.
    later = compute_status(again, _deployment_status(1, 1, 1), "2025-01-02T03:34:05Z")
    assert status_patch(again, later) == {}
    assert later.last_remediation == parse_time(NOW)
    assert _conditions(later)["MemoryHealthy"] == ("False", "RuntimeGPUOOM")
    flipped = compute_status(again, _deployment_status(0, 1, 1), "2025-01-02T03:34:05Z")
    ready = flipped.condition("Ready")
    assert ready is not None and ready.last_transition_time == parse_time("2025-01-02T03:34:05Z")
    patch = status_patch(again, flipped)
    assert sorted(patch) == ["conditions", "readyReplicas"]


def _memory_healthy(status: Any) -> dict[str, Any]:
    condition = status.condition("MemoryHealthy")
    assert condition is not None
    return {
        k: v
        for k, v in condition.to_api().items()
        if k in ("status", "reason", "message", "lastTransitionTime")
    }


def test_memory_healthy_recovers_after_the_quiet_period() -> None:
    oom = {
        "type": "MemoryHealthy",
        "status": "False",
        "reason": "GPUOutOfMemoryAtRuntime",
        "message": "pod qwen-a: step failed",
        "lastTransitionTime": "2025-01-02T03:00:00Z",
        "observedGeneration": 3,
    }
    # A second OOM at 03:30 keeps the transition time and restarts the quiet period.
    status = {"conditions": [oom], "lastOutOfMemory": "2025-01-02T03:30:00Z"}
    server = make_server({"remediation": {"memoryHealthyAfterSeconds": 600}}, status=status)
    deployment = _deployment_status(1, 1, 1)
    still = compute_status(server, deployment, "2025-01-02T03:39:59Z")
    assert _memory_healthy(still) == {
        "status": "False",
        "reason": "GPUOutOfMemoryAtRuntime",
        "message": "pod qwen-a: step failed",
        "lastTransitionTime": "2025-01-02T03:00:00Z",
    }
    recovered = compute_status(server, deployment, "2025-01-02T03:40:00Z")
    assert _memory_healthy(recovered) == {
        "status": "True",
        "reason": "NoRecentMemoryEvents",
        "message": "no out-of-memory termination for 600s (the last at 2025-01-02T03:30:00Z)",
        "lastTransitionTime": "2025-01-02T03:40:00Z",
    }
    patch = status_patch(server, recovered)
    assert [c for c in patch["conditions"] if c["type"] == "MemoryHealthy"] == [
        {**_memory_healthy(recovered), "type": "MemoryHealthy", "observedGeneration": 3}
    ]
    # Once recovered, the next resync changes nothing.
    stored = make_server(
        {"remediation": {"memoryHealthyAfterSeconds": 600}},
        status={**recovered.to_api(), "lastOutOfMemory": "2025-01-02T03:30:00Z"},
    )
    assert status_patch(stored, compute_status(stored, deployment, "2025-01-02T04:00:00Z")) == {}


def test_memory_healthy_follows_last_out_of_memory() -> None:
    healthy = compute_status(make_server(), _deployment_status(1, 1, 1), NOW)
    assert _memory_healthy(healthy) == {
        "status": "True",
        "reason": "NoMemoryEvents",
        "message": "no out-of-memory events recorded",
        "lastTransitionTime": NOW,
    }
    # The condition was lost to a concurrent write, but lastOutOfMemory is recent: False.
    lost = make_server(status={**healthy.to_api(), "lastOutOfMemory": "2025-01-02T03:00:00Z"})
    assert _memory_healthy(compute_status(lost, _deployment_status(1, 1, 1), NOW)) == {
        "status": "False",
        "reason": "OutOfMemory",
        "message": "out-of-memory termination at 2025-01-02T03:00:00Z",
        "lastTransitionTime": NOW,
    }
    # A False condition written without lastOutOfMemory counts from its transition time.
    legacy = make_server(
        status={
            "conditions": [
                {
                    "type": "MemoryHealthy",
                    "status": "False",
                    "reason": "HostOutOfMemory",
                    "lastTransitionTime": "2025-01-02T02:04:05Z",
                }
            ]
        }
    )
    assert _memory_healthy(compute_status(legacy, _deployment_status(1, 1, 1), NOW)) == {
        "status": "True",
        "reason": "NoRecentMemoryEvents",
        "message": "no out-of-memory termination for 3600s (the last at 2025-01-02T02:04:05Z)",
        "lastTransitionTime": NOW,
    }


def test_merge_patch() -> None:
    assert merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"a": 1, "b": {"c": 1, "d": 2}}) == {}
    assert merge_patch(
        {"a": 1, "b": {"c": 1, "d": 2}, "e": 5}, {"a": 2, "b": {"c": 1}, "f": [1]}
    ) == {"a": 2, "b": {"d": None}, "e": None, "f": [1]}


class _StatusWrites:
    def __init__(self, conflicts: bool = False) -> None:
        self.patches: list[dict[str, Any]] = []
        self.versions: list[str | None] = []
        self.conflicts = conflicts

    def patch_status(
        self, namespace: str, name: str, patch: dict[str, Any], resource_version: str | None
    ) -> bool:
        self.versions.append(resource_version)
        if self.conflicts:
            return False
        self.patches.append(patch)
        return True


def test_a_deployment_event_never_reports_an_unreconciled_generation() -> None:
    server = make_server({"replicas": 2})  # generation 3, never reconciled
    kube = _StatusWrites()
    assert (
        refresh_status(kube, server, _deployment_status(2, 2, 2), NOW, resource_version="7") == {}
    )  # type: ignore[arg-type]
    assert kube.patches == []
    # Generation 2 was reconciled; 3 arrived while the operator was down and waits for its
    # reconcile: the event's status still describes generation 2.
    status = server.status.model_copy(update={"observed_generation": 2})
    reconciled = server.model_copy(update={"status": status})
    patch = refresh_status(kube, reconciled, _deployment_status(2, 2, 2), NOW, resource_version="8")  # type: ignore[arg-type]
    assert kube.patches == [patch] and kube.versions == ["8"]
    assert "observedGeneration" not in patch
    assert {c["observedGeneration"] for c in patch["conditions"]} == {2}


def test_a_refresh_from_an_older_read_never_overwrites_a_newer_status() -> None:
    """The patch is made at the version the server was read at: a reconcile that wrote status
    since (a new PolicyFits, say) wins, and nothing is written from the stale read."""
    status = make_server({"replicas": 2}).status.model_copy(update={"observed_generation": 3})
    server = make_server({"replicas": 2}).model_copy(update={"status": status})
    kube = _StatusWrites(conflicts=True)
    assert (
        refresh_status(kube, server, _deployment_status(2, 2, 2), NOW, resource_version="9") == {}
    )  # type: ignore[arg-type]
    assert (kube.versions, kube.patches) == (["9"], [])
