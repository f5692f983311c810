"""`failures`: which errors no retry can fix, once for the webhook, the reconcile and Stalled."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from pagekeeper_operator.failures import (
    UnreadableDataError,
    describe,
    is_permanent,
    is_permanent_status,
)
from pagekeeper_operator.remediation.actions import server_info
from pagekeeper_operator.remediation.payload import MalformedNotificationError, parse_notification
from pagekeeper_operator.timestamps import TimestampError, parse_time


def test_the_api_s_4xx_are_permanent_except_those_a_retry_can_pass() -> None:
    statuses = [None, 200, 400, 401, 403, 404, 405, 408, 409, 410, 415, 422, 429, 500, 503]
    assert [s for s in statuses if is_permanent_status(s)] == [400, 403, 404, 405, 415, 422]


def test_only_refusals_and_unreadable_data_are_permanent() -> None:
    with pytest.raises(TimestampError) as stamp:
        parse_time("yesterday")
    with pytest.raises(MalformedNotificationError) as body:
        parse_notification(b"{}")
    permanent: list[BaseException] = [
        ApiException(status=403, reason="Forbidden"),
        stamp.value,
        body.value,
        UnreadableDataError("LLMServer prod/chat cannot be read"),
    ]
    try:
        int("x")
    except ValueError as error:
        bug: ValueError = error
    retryable: list[BaseException] = [
        ApiException(status=401, reason="Unauthorized"),
        ApiException(status=409, reason="Conflict"),
        ApiException(status=503, reason="Service Unavailable"),
        ApiException(status=None, reason="connection dropped"),
        bug,  # a plain ValueError is a bug, not bad data
        KeyError("spec"),
        RuntimeError("status of prod/chat kept changing; not written"),
        ConnectionError("API server unreachable"),
    ]
    assert [is_permanent(e) for e in permanent] == [True] * len(permanent)
    assert [is_permanent(e) for e in retryable] == [False] * len(retryable)


def test_a_stored_llmserver_its_models_refuse_is_unreadable_data() -> None:
    body = {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "metadata": {"name": "chat", "namespace": "prod"},
        "spec": {"model": "Qwen/Qwen3-0.6B", "replicas": "many"},
    }
    with pytest.raises(UnreadableDataError, match=r"^LLMServer prod/chat cannot be read: ") as e:
        server_info(body, [])
    assert isinstance(e.value.__cause__, ValidationError)
    assert is_permanent(e.value)


def test_a_malformed_notification_names_its_fields() -> None:
    with pytest.raises(MalformedNotificationError) as not_json:
        parse_notification(b"{not json")
    assert not_json.value.message.startswith("body is not JSON: ")
    assert not_json.value.fields is None
    with pytest.raises(MalformedNotificationError) as wrong:
        parse_notification(b'{"version": "3"}')
    assert wrong.value.message == "not an Alertmanager notification"
    assert [f["field"] for f in wrong.value.fields or []] == [
        "version", "groupKey", "status", "receiver", "alerts",
    ]  # fmt: skip


def test_describe_names_the_api_s_answer_or_the_error() -> None:
    assert describe(ApiException(status=403, reason="Forbidden")) == (
        "the API server answered 403 Forbidden"
    )
    assert describe(KeyError("spec")) == "KeyError: 'spec'"
