"""spec.gateway.kvEvents: the spec's refusals, the vLLM versions that take the flag
(PolicyHonored), and the prefix cache the events need (`effective`)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from pagekeeper_operator.api.gateway import (
    DISTINCT_PORTS_RULE,
    PORT_RULE,
    PREFIX_CACHE_RULE,
    REPLAY_PORT_RULE,
)
from pagekeeper_operator.policy.effective import compose
from pagekeeper_operator.policy.vllm_compat import policy_verdict
from pagekeeper_operator.status.conditions import runtime_conditions
from tests.operator.servers import make_server
from tests.operator.test_effective import promoted, with_status

NOW = "2026-11-29T01:00:00Z"


def test_defaults_are_vllms_and_off() -> None:
    events = make_server().spec.gateway.kv_events
    assert (events.enabled, events.port, events.replay_port) == (False, 5557, None)
    assert (events.topic, events.buffer_steps) == ("", 10_000)


@pytest.mark.parametrize(
    ("events", "rule"),
    [
        ({"port": 8000}, PORT_RULE),
        ({"port": 8001}, PORT_RULE),
        ({"replayPort": 8000}, REPLAY_PORT_RULE),
        ({"replayPort": 5557}, DISTINCT_PORTS_RULE),
        ({"port": 6000, "replayPort": 6000}, DISTINCT_PORTS_RULE),
    ],
)
def test_a_port_the_pod_uses_is_refused_naming_the_field(
    events: dict[str, Any], rule: dict[str, str]
) -> None:
    with pytest.raises(ValidationError, match=re.escape(rule["message"])):
        make_server({"gateway": {"kvEvents": {"enabled": True, **events}}})


@pytest.mark.parametrize(
    ("events", "field"),
    [
        ({"port": 80}, "port"),
        ({"replayPort": 70000}, "replayPort"),
        ({"bufferSteps": 0}, "bufferSteps"),
    ],
)
def test_bounds_are_refused(events: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(f"spec.gateway.kvEvents.{field}\n")):
        make_server({"gateway": {"kvEvents": events}})


def test_events_without_the_prefix_cache_are_refused() -> None:
    spec = {"memoryPolicy": {"enablePrefixCaching": False}}
    with pytest.raises(ValidationError, match=re.escape(PREFIX_CACHE_RULE["message"])):
        make_server({**spec, "gateway": {"kvEvents": {"enabled": True}}})
    assert PREFIX_CACHE_RULE["fieldPath"] == ".gateway.kvEvents.enabled"
    make_server({**spec, "gateway": {"kvEvents": {"enabled": False}}})


def test_policy_honored_names_the_field_for_a_vllm_without_it() -> None:
    policy = make_server().spec.memory_policy
    status, reason, message = policy_verdict(
        policy, "vllm/vllm-openai:v0.10.2", has_kv_events=True
    )[1:]
    assert (status, reason) == ("False", "IgnoredByRuntime")
    assert message == (
        "vLLM 0.10.2 ignores spec.gateway.kvEvents (pagekeeper checks --kv-events-config against "
        "vLLM 0.11.0 and later only, so the operator leaves it out and the pods publish no KV "
        "events); vLLM 0.11.0 and later honour it"
    )
    assert policy_verdict(policy, "vllm/vllm-openai:v0.10.2")[1] == "True"
    assert policy_verdict(policy, "vllm/vllm-openai:v0.11.0", has_kv_events=True)[1] == "True"
    unknown = policy_verdict(policy, "vllm/vllm-openai:latest", has_kv_events=True)
    assert unknown[1:3] == ("Unknown", "RuntimeVersionUnknown")
    assert "spec.gateway.kvEvents" in unknown[3]


def test_the_condition_reads_the_spec() -> None:
    spec = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.10.2"}
    on = make_server({**spec, "gateway": {"kvEvents": {"enabled": True}}})
    [honored, _] = runtime_conditions(on, None, NOW)
    assert (honored.type, honored.status) == ("PolicyHonored", "False")
    assert "spec.gateway.kvEvents" in honored.message
    [honored, _] = runtime_conditions(make_server(spec), None, NOW)
    assert honored.status == "True"


def test_a_tuned_prefix_cache_off_does_not_hold_while_events_are_on() -> None:
    change = {"changes": [promoted("enablePrefixCaching", "false", "true")]}
    plain = with_status(make_server(), tuning=change)
    assert compose(plain).policy.enable_prefix_caching is False
    on = with_status(make_server({"gateway": {"kvEvents": {"enabled": True}}}), tuning=change)
    assert compose(on).policy.enable_prefix_caching is True
    assert compose(on).changes == ()
