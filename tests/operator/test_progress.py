"""Reconciling and Stalled (`progress`) and the one-sentence write failures (`refusal`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
from pagekeeper_operator.render import ClusterFeatures
from pagekeeper_operator.status.conditions import compute_status
from pagekeeper_operator.status.progress import unreadable_status
from pagekeeper_operator.status.refusal import is_refusal, is_refused, write_failure
from tests.operator.servers import DEFAULT_IMAGES, make_server, server_body

NOW = "2025-01-02T03:04:05Z"
CANARY = {
    "templateHash": "new",
    "stableTemplateHash": "old",
    "startedAt": NOW,
}
# What a v1.33 API server answers to a Deployment whose env holds a name with '='.
ENV_REFUSAL = json.dumps(
    {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": 'Deployment.apps "badenv" is invalid: spec.template.spec.containers[0].env[8]'
        '.name: Invalid value: "A=B": a valid environment variable name must not contain "="',
        "reason": "Invalid",
        "details": {
            "name": "badenv",
            "group": "apps",
            "kind": "Deployment",
            "causes": [
                {
                    "reason": "FieldValueInvalid",
                    "message": 'Invalid value: "A=B": a valid environment variable name must '
                    'not contain "="',
                    "field": "spec.template.spec.containers[0].env[8].name",
                }
            ],
        },
        "code": 422,
    }
)
REFUSED = (
    "the API server refused the Deployment: spec.template.spec.containers[0].env[8].name: "
    'Invalid value: "A=B": a valid environment variable name must not contain "="'
)


def _deployment(ready: int, updated: int, total: int, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 2,
            "replicas": total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            **status,
        },
    }


def _progress(status: Any) -> dict[str, tuple[str, str, str]]:
    return {
        c.type: (c.status, c.reason, c.message)
        for c in status.conditions
        if c.type in {"Reconciling", "Stalled"}
    }


def test_write_failure_names_the_first_cause_in_one_sentence() -> None:
    assert write_failure("Deployment", 422, "Unprocessable Entity", ENV_REFUSAL) == REFUSED
    two = json.loads(ENV_REFUSAL)
    two["details"]["causes"].append({"field": "spec.x", "message": "Required value"})
    assert write_failure("Deployment", 422, "Unprocessable Entity", json.dumps(two)) == (
        REFUSED + " (and 1 more)"
    )
    forbidden = json.dumps({"kind": "Status", "message": "services is forbidden", "code": 403})
    assert write_failure("Service", 403, "Forbidden", forbidden) == (
        "the API server refused the Service: services is forbidden"
    )
    assert write_failure("Deployment", 503, "Service Unavailable", "<html>") == (
        "the API server could not apply the Deployment (503 Service Unavailable)"
    )
    assert write_failure("Deployment", 409, "Conflict", forbidden) == (
        "the API server could not apply the Deployment (409 Conflict): services is forbidden"
    )
    assert [is_refusal(s) for s in (400, 403, 404, 409, 410, 422, 429, 500, None)] == [
        True, True, True, False, False, True, False, False, False,
    ]  # fmt: skip
    assert is_refused(REFUSED) and not is_refused("applying Deployment/qwen failed")


def test_a_refused_apply_stalls_and_a_retryable_one_reconciles() -> None:
    server = make_server({"replicas": 2})
    refused = compute_status(server, None, NOW, apply_error=REFUSED)
    assert _progress(refused) == {
        "Reconciling": ("False", "Stalled", "no progress is possible until the spec changes"),
        "Stalled": ("True", "ApplyFailed", REFUSED),
    }
    retry = "the API server could not apply the Deployment (503 Service Unavailable)"
    retried = compute_status(server, None, NOW, apply_error=retry)
    assert _progress(retried) == {
        "Reconciling": ("True", "Retrying", retry),
        "Stalled": ("False", "AsExpected", ""),
    }


def test_reconciling_while_created_rolled_out_analyzed_or_drained() -> None:
    server = make_server({"replicas": 2})
    assert _progress(compute_status(server, None, NOW))["Reconciling"] == (
        "True",
        "Creating",
        "the Deployment does not exist yet",
    )
    assert _progress(compute_status(server, _deployment(1, 1, 2), NOW))["Reconciling"] == (
        "True",
        "RollingOut",
        "1/2 replicas run the current pod template",
    )
    # All pods run the new template, none ready yet: the Deployment still reports progress.
    starting = _deployment(
        0,
        2,
        2,
        conditions=[{"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}],
    )
    assert _progress(compute_status(server, starting, NOW))["Reconciling"] == (
        "True",
        "RollingOut",
        "0/2 replicas ready; the rollout goes on",
    )
    # The same after the rollout completed (pods failing later): nothing is under way.
    done = _deployment(
        0,
        2,
        2,
        conditions=[{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
    )
    assert _progress(compute_status(server, done, NOW))["Reconciling"][:2] == ("False", "Idle")
    analyzing = make_server(
        {"replicas": 2, "rollout": {"canary": {"enabled": True}}},
        status={"canary": {**CANARY, "phase": "Analyzing", "message": "1 canary pod analyzed"}},
    )
    assert _progress(compute_status(analyzing, _deployment(2, 2, 2), NOW)) == {
        "Reconciling": ("True", "CanaryAnalyzing", "1 canary pod analyzed"),
        "Stalled": ("False", "AsExpected", ""),
    }
    # Updated and ready, one pod more than wanted: the scale-down's pod is terminating.
    drained = compute_status(server, _deployment(3, 3, 3), NOW)
    draining = ("True", "Draining", "1 surplus pods are terminating")
    assert _progress(drained)["Reconciling"] == draining
    at_rest = compute_status(server, _deployment(2, 2, 2), NOW)
    assert _progress(at_rest) == {
        "Reconciling": ("False", "Idle", "nothing is under way"),
        "Stalled": ("False", "AsExpected", ""),
    }


def test_stalled_past_the_deadline_after_a_rollback_or_when_the_policy_does_not_fit() -> None:
    server = make_server({"replicas": 2})
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "qwen-5d8f" has timed out progressing.',
    }
    stuck = compute_status(server, _deployment(0, 2, 2, conditions=[deadline]), NOW)
    assert _progress(stuck)["Stalled"] == (
        "True",
        "ProgressDeadlineExceeded",
        'ReplicaSet "qwen-5d8f" has timed out progressing.',
    )
    assert _progress(stuck)["Reconciling"][0] == "False"
    rolled_back = make_server(
        {"replicas": 2, "rollout": {"canary": {"enabled": True}}},
        status={"canary": {**CANARY, "phase": "Failed", "message": "oom rate 0.5 > 0"}},
    )
    assert _progress(compute_status(rolled_back, _deployment(2, 2, 2), NOW))["Stalled"] == (
        "True",
        "CanaryRolledBack",
        "the canary failed and was rolled back; change the pod template to try again: "
        "oom rate 0.5 > 0",
    )
    fits = {
        "type": "PolicyFits",
        "status": "False",
        "reason": "DoesNotFit",
        "message": "the KV cache needs 90 GiB of the 80 GiB GPU",
    }
    unfit = make_server({"replicas": 2}, status={"conditions": [fits]})
    assert _progress(compute_status(unfit, _deployment(2, 2, 2), NOW))["Stalled"] == (
        "True",
        "PolicyDoesNotFit",
        "the KV cache needs 90 GiB of the 80 GiB GPU",
    )


def test_every_condition_carries_the_generation() -> None:
    status = compute_status(make_server({"replicas": 2}), _deployment(2, 2, 2), NOW)
    assert {c.type: c.observed_generation for c in status.conditions} == {
        "Ready": 3,
        "Progressing": 3,
        "Degraded": 3,
        "Reconciling": 3,
        "Stalled": 3,
        "MemoryHealthy": 3,
    }


@pytest.mark.parametrize(
    ("pod_template", "field"),
    [
        ({"env": [{"name": "A=B", "value": "1"}]}, "env.0.name"),
        ({"env": [{"name": "1ABC", "value": "1"}]}, "env.0.name"),
        ({"volumes": [{"name": "Models", "emptyDir": {}}]}, "volumes.0"),
        ({"volumes": [{"emptyDir": {}}]}, "volumes.0"),
        ({"volumeMounts": [{"name": "m_1", "mountPath": "/m"}]}, "volumeMounts.0.name"),
    ],
)
def test_the_models_refuse_what_the_pod_would(pod_template: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        make_server({"podTemplate": pod_template})
    locations = [".".join(str(p) for p in e["loc"]) for e in raised.value.errors()]
    assert locations == [f"spec.podTemplate.{field}"]


def test_the_models_accept_the_api_servers_own_names() -> None:
    server = make_server(
        {
            "podTemplate": {
                "env": [{"name": "my.env-name_1", "value": "1"}, {"name": "_X"}],
                "volumes": [{"name": "models-1", "emptyDir": {}}],
                "volumeMounts": [{"name": "models-1", "mountPath": "/m"}],
            }
        }
    )
    assert [e.name for e in server.spec.pod_template.env] == ["my.env-name_1", "_X"]


class RefusingKube:
    """A `Kube` whose API server refuses every Deployment with `ENV_REFUSAL`."""

    field_manager = "pagekeeper-operator"

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def features(self) -> ClusterFeatures:
        return ClusterFeatures()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        return None

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        return []

    def observe(self, namespace: str, keys: Any) -> dict[Any, Any]:
        return {}

    def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        if manifest["kind"] == "Deployment":
            exc = ApiException(status=422, reason="Unprocessable Entity")
            exc.body = ENV_REFUSAL
            raise exc
        return manifest

    def create_event(self, body: dict[str, Any]) -> None:
        self.events.append(body)


def test_a_refused_apply_writes_one_sentence_and_posts_the_raw_answer_once() -> None:
    kube = RefusingKube()
    server = make_server({"replicas": 2})
    first = reconcile(kube, server, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert first.is_permanent_error
    conditions = {c["type"]: c for c in first.status_patch["conditions"]}
    assert (conditions["Stalled"]["reason"], conditions["Stalled"]["message"]) == (
        "ApplyFailed",
        REFUSED,
    )
    assert conditions["Degraded"]["message"] == REFUSED
    (event,) = kube.events
    assert (event["type"], event["reason"]) == ("Warning", "ApplyFailed")
    assert event["message"] == (
        f"applying Deployment/qwen failed (422 Unprocessable Entity): {ENV_REFUSAL}"
    )
    # The resync retries the stalled server; the Event is not posted again.
    stalled = make_server({"replicas": 2}, status=first.status_patch)
    again = reconcile(kube, stalled, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert again.status_patch == {}
    assert len(kube.events) == 1


def test_a_stored_server_its_models_refuse_is_stalled_naming_each_field() -> None:
    """Stored before the CRD said `format: date-time`: a time stamp that does not parse. The
    operator cannot act on it, and says which field in Stalled (kstatus reads Failed)."""
    body = server_body()
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "",
             "lastTransitionTime": "2025-01-02T03:00:00Z"}  # fmt: skip
    torn = {"type": "Degraded", "status": "False", "lastTransitionTime": "soon"}
    body["status"] = {
        "canary": {**CANARY, "phase": "Analyzing", "startedAt": "yesterday"},
        "conditions": [ready, torn],
    }
    with pytest.raises(ValidationError) as refused:
        LLMServer.from_body(body)
    message, conditions = unreadable_status(body, refused.value, NOW)
    assert message == (
        "the stored LLMServer does not validate: status.conditions.1.lastTransitionTime: Value "
        "error, unreadable time stamp 'soon' (RFC 3339 expected); status.canary.startedAt: "
        "Value error, unreadable time stamp 'yesterday' (RFC 3339 expected)"
    )
    assert conditions == [
        ready,  # kept as stored; the torn one is dropped, it cannot be written back
        {"type": "Reconciling", "status": "False", "reason": "Stalled",
         "message": "no progress is possible until the named fields are corrected",
         "lastTransitionTime": NOW},
        {"type": "Stalled", "status": "True", "reason": "Unreadable", "message": message,
         "lastTransitionTime": NOW},
    ]  # fmt: skip
    # Said again later: the transition times stay.
    body["status"]["conditions"] = conditions
    _, again = unreadable_status(body, refused.value, "2025-01-02T04:00:00Z")
    assert again == conditions
