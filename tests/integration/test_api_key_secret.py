"""spec.apiKey naming a Secret (or a key) that does not exist, on the real control plane: the
operator says so (ApiKeyAvailable, Stalled, a Warning Event naming the Secret and the key) and
rolls out no pod that could not start; once the key exists the rollout goes on by itself, and a
later change to a missing Secret leaves the running pods alone."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import OperatorProcess
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_or_none,
    get_server,
    wait_ready,
)

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

NAME = "locked"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "resources": {"gpus": 1, "gpuType": "NVIDIA-H100-80GB-HBM3"},
    "apiKey": {"secretName": "chat-key"},
}


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _api_key_reason(cluster: Cluster, namespace: str, reason: str) -> dict[str, Any] | None:
    """The server once status for its current generation says `reason` for the API key."""
    obj = get_server(cluster, namespace, NAME)
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    condition = _conditions(obj).get("ApiKeyAvailable", {})
    return obj if condition.get("reason") == reason else None


def _events(cluster: Cluster, namespace: str) -> list[tuple[str, str, str]]:
    events = client.CoreV1Api(cluster.api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=LLMServer,involvedObject.name={NAME}"
    )
    return [(e.type, e.reason, e.message) for e in events.items]


def _deployment(cluster: Cluster, namespace: str) -> Any:
    apps = client.AppsV1Api(cluster.api)
    return get_or_none(apps.read_namespaced_deployment, NAME, namespace)


def _secret(cluster: Cluster, namespace: str, name: str, data: dict[str, str]) -> None:
    body = client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
    core = client.CoreV1Api(cluster.api)
    if get_or_none(core.read_namespaced_secret, name, namespace) is None:
        core.create_namespaced_secret(namespace, body)
    else:
        core.replace_namespaced_secret(name, namespace, body)


def _key_source(deployment: Any) -> tuple[str, str]:
    [env] = [
        e for e in deployment.spec.template.spec.containers[0].env if e.name == "PAGEKEEPER_API_KEY"
    ]
    ref = env.value_from.secret_key_ref
    return ref.name, ref.key


def test_a_missing_api_key_secret_holds_the_rollout_says_why_and_recovers(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver(NAME, SPEC))
    obj = wait_for(
        lambda: _api_key_reason(cluster, namespace, "SecretMissing"), timeout=60, what="missing"
    )
    conditions = _conditions(obj)
    key = conditions["ApiKeyAvailable"]
    assert key["status"] == "False"
    assert key["message"].startswith(f"Secret {namespace}/chat-key does not exist (key 'api-key')")
    stalled = conditions["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "SecretMissing")
    assert stalled["message"] == key["message"]
    assert conditions["Reconciling"]["status"] == "False"
    assert _deployment(cluster, namespace) is None  # no pod that cannot start
    warning = ("Warning", "SecretMissing", key["message"])
    wait_for(lambda: warning in _events(cluster, namespace), timeout=30, what="the Event")

    # The Secret without the key: still held, and said differently.
    _secret(cluster, namespace, "chat-key", {"token": "not-the-key"})
    obj = wait_for(
        lambda: _api_key_reason(cluster, namespace, "SecretKeyMissing"), timeout=60, what="key"
    )
    message = _conditions(obj)["ApiKeyAvailable"]["message"]
    assert f"Secret {namespace}/chat-key has no key 'api-key' (keys: token)" in message
    assert "not-the-key" not in str(obj)  # values never reach status
    assert _deployment(cluster, namespace) is None

    # The key with a file's trailing newline: no request could carry it, so still held.
    _secret(cluster, namespace, "chat-key", {"api-key": "s3cret-value\n"})
    obj = wait_for(
        lambda: _api_key_reason(cluster, namespace, "SecretKeyUnusable"), timeout=60, what="ws"
    )
    message = _conditions(obj)["ApiKeyAvailable"]["message"]
    assert message.startswith(f"Secret {namespace}/chat-key key 'api-key' begins or ends with")
    assert "s3cret-value" not in str(obj) and _deployment(cluster, namespace) is None

    # The key appears: the next resync rolls the server out with no change to it.
    _secret(cluster, namespace, "chat-key", {"api-key": "s3cret-value"})
    wait_ready(cluster, namespace, NAME, 1)
    # the status refreshed from the new pods' events may land before the resync's own write
    obj = wait_for(
        lambda: _api_key_reason(cluster, namespace, "SecretFound"), timeout=60, what="key found"
    )
    conditions = _conditions(obj)
    assert (conditions["ApiKeyAvailable"]["status"], conditions["Stalled"]["status"]) == (
        "True",
        "False",
    )
    assert "s3cret-value" not in str(obj)
    assert _key_source(_deployment(cluster, namespace)) == ("chat-key", "api-key")
    assert any(
        (kind, reason) == ("Normal", "SecretFound")
        for kind, reason, _ in _events(cluster, namespace)
    )

    # A change to a Secret that does not exist: the running pods keep their template.
    running = _deployment(cluster, namespace).spec.template
    apply_server(cluster, namespace, llmserver(NAME, {**SPEC, "apiKey": {"secretName": "other"}}))
    obj = wait_for(
        lambda: _api_key_reason(cluster, namespace, "SecretMissing"), timeout=60, what="held"
    )
    conditions = _conditions(obj)
    assert conditions["Stalled"]["reason"] == "SecretMissing"
    assert conditions["Stalled"]["message"].startswith(f"Secret {namespace}/other does not exist")
    assert conditions["Ready"]["status"] == "True"  # the old pods still serve
    held = _deployment(cluster, namespace)
    assert held.spec.template.metadata.annotations == running.metadata.annotations
    assert _key_source(held) == ("chat-key", "api-key")
    assert held.status.ready_replicas == 1
