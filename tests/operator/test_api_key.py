"""spec.apiKey's Secret (`api_key`): the verdict, the conditions it sets, the Events, and the
reconcile holding the rollout over an in-memory Kubernetes."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.status import Condition
from pagekeeper_operator.controllers.reconcile import reconcile
from pagekeeper_operator.status.api_key import ApiKeyCheck, api_key_event, check_api_key
from pagekeeper_operator.status.conditions import compute_status
from tests.operator.servers import DEFAULT_IMAGES, make_server, server_body
from tests.operator.test_reconcile_fit import MemoryKube

NOW = "2026-11-29T01:00:00Z"
LOCKED = {"apiKey": {"secretName": "chat-key"}}
SECRET_KEY = ("v1", "Secret", "chat-key")


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def test_the_verdict_names_the_secret_and_the_key_never_a_value() -> None:
    server = make_server(LOCKED)
    assert check_api_key(make_server(), None) is None  # no spec.apiKey: nothing to check
    missing = check_api_key(server, None)
    assert missing == ApiKeyCheck(
        "False",
        "SecretMissing",
        "Secret ml/chat-key does not exist (key 'api-key'): pods that read spec.apiKey cannot "
        "start, so the rollout is held until it exists",
    )
    assert missing.holds_rollout
    no_key = check_api_key(server, {"data": {"token": "c2VjcmV0", "b": ""}})
    assert no_key is not None and no_key.holds_rollout
    assert no_key.reason == "SecretKeyMissing"
    assert no_key.message.startswith("Secret ml/chat-key has no key 'api-key' (keys: b, token): ")
    assert "c2VjcmV0" not in no_key.message
    empty = check_api_key(server, {"data": None})
    assert empty is not None and "(keys: none)" in empty.message
    found = check_api_key(server, {"data": {"api-key": "c2VjcmV0"}})
    assert found == ApiKeyCheck("True", "SecretFound", "Secret ml/chat-key holds key 'api-key'")
    unreadable = check_api_key(server, None, unreadable="403 Forbidden")
    assert unreadable is not None and not unreadable.holds_rollout
    assert (unreadable.status, unreadable.reason) == ("Unknown", "SecretUnreadable")
    assert "could not be read (403 Forbidden)" in unreadable.message


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "is empty, which would leave /v1/* open"),
        ("sk-abc\n", "begins or ends with whitespace"),
        (" sk-abc", "begins or ends with whitespace"),
    ],
)
def test_a_key_no_request_could_carry_holds_the_rollout(value: str, problem: str) -> None:
    encoded = base64.b64encode(value.encode()).decode()
    unusable = check_api_key(make_server(LOCKED), {"data": {"api-key": encoded}})
    assert unusable is not None and unusable.holds_rollout
    assert (unusable.status, unusable.reason) == ("False", "SecretKeyUnusable")
    assert unusable.message.startswith(f"Secret ml/chat-key key 'api-key' {problem}")
    assert unusable.message.endswith(
        "no pod should serve with it, so the rollout is held until it changes"
    )
    assert "sk-abc" not in unusable.message and (not encoded or encoded not in unusable.message)
    binary = check_api_key(make_server(LOCKED), {"data": {"api-key": "//79"}})
    assert binary is not None and binary.reason == "SecretKeyUnusable"
    assert "is not UTF-8 text" in binary.message


def test_events_on_each_change_of_reason_only() -> None:
    missing = check_api_key(make_server(LOCKED), None)
    found = check_api_key(make_server(LOCKED), {"data": {"api-key": "eA=="}})
    assert missing is not None and found is not None

    def previous(status: str, reason: str) -> Condition:
        return Condition(type="ApiKeyAvailable", status=status, reason=reason, message="")  # type: ignore[arg-type]

    assert api_key_event(None, missing) == ("Warning", "SecretMissing", missing.message)
    assert api_key_event(previous("False", "SecretMissing"), missing) is None  # said once
    assert api_key_event(previous("False", "SecretKeyMissing"), missing) is not None
    assert api_key_event(None, found) is None  # found from the start: nothing to say
    assert api_key_event(previous("False", "SecretMissing"), found) == (
        "Normal",
        "SecretFound",
        "Secret ml/chat-key holds key 'api-key': the rollout goes on",
    )
    assert api_key_event(previous("True", "SecretFound"), None) is None


def test_stalled_reads_the_missing_secret_and_a_refresh_keeps_the_condition() -> None:
    server = make_server(LOCKED)
    missing = check_api_key(server, None)
    status = compute_status(server, None, NOW, api_key=missing).to_api()
    conditions = _conditions(status)
    assert conditions["ApiKeyAvailable"]["status"] == "False"
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == (
        "True",
        "SecretMissing",
    )
    assert conditions["Stalled"]["message"] == conditions["ApiKeyAvailable"]["message"]
    assert conditions["Reconciling"]["status"] == "False"
    # A status refresh from a Deployment event reads no Secret: the last verdict stays.
    refreshed = LLMServer.from_body(server_body(LOCKED, status=status))
    again = _conditions(compute_status(refreshed, None, NOW).to_api())
    assert again["ApiKeyAvailable"] == conditions["ApiKeyAvailable"]
    assert again["Stalled"]["reason"] == "SecretMissing"
    # spec.apiKey removed: the condition goes with it.
    unlocked = LLMServer.from_body(server_body(status=status))
    assert "ApiKeyAvailable" not in _conditions(compute_status(unlocked, None, NOW).to_api())


def test_the_reconcile_holds_the_rollout_until_the_key_exists() -> None:
    kube = MemoryKube([])
    result = reconcile(kube, make_server(LOCKED), DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert ("apps/v1", "Deployment", "qwen") not in kube.objects
    assert ("v1", "Service", "qwen") in kube.objects  # only the pods wait
    status = result.status_patch
    assert _conditions(status)["Stalled"]["reason"] == "SecretMissing"
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Warning", "SecretMissing")]

    # The same again: no second Event.
    stalled = make_server(LOCKED, status=status)
    reconcile(kube, stalled, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert len(kube.events) == 1

    kube.objects[SECRET_KEY] = {"data": {"api-key": "c2VjcmV0"}}
    result = reconcile(kube, stalled, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    deployment = kube.objects[("apps/v1", "Deployment", "qwen")]
    [env] = [
        e
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "PAGEKEEPER_API_KEY"
    ]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "chat-key", "key": "api-key"}
    assert _conditions(result.status_patch)["ApiKeyAvailable"]["reason"] == "SecretFound"
    assert [(e["type"], e["reason"]) for e in kube.events][-1] == ("Normal", "SecretFound")

    # A change to a Secret that is not there keeps the running template.
    running = deployment["spec"]["template"]
    moved = make_server({"apiKey": {"secretName": "other"}}, status=result.status_patch)
    reconcile(kube, moved, DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert kube.objects[("apps/v1", "Deployment", "qwen")]["spec"]["template"] == running


class ForbiddenSecrets(MemoryKube):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        if kind == "Secret":
            raise ApiException(status=403, reason="Forbidden")
        return super().get(api_version, kind, namespace, name)


def test_a_secret_the_operator_may_not_read_holds_nothing() -> None:
    kube = ForbiddenSecrets([])
    result = reconcile(kube, make_server(LOCKED), DEFAULT_IMAGES, now=NOW)  # type: ignore[arg-type]
    assert ("apps/v1", "Deployment", "qwen") in kube.objects
    conditions = _conditions(result.status_patch)
    assert (conditions["ApiKeyAvailable"]["status"], conditions["Stalled"]["status"]) == (
        "Unknown",
        "False",
    )
    assert kube.events == []
