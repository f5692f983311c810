"""The API server refuses a bad spec.gateway.kvEvents naming the field (CEL and schema bounds),
and stores a good one with vLLM's defaults filled in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import Cluster
from harness.loop import llmserver
from pagekeeper_operator.api.gateway import (
    DISTINCT_PORTS_RULE,
    PORT_RULE,
    PREFIX_CACHE_RULE,
    REPLAY_PORT_RULE,
)
from tests.integration import operator_fixture

llmserver_crd = operator_fixture.llmserver_crd

CEL_CASES = [
    ({"port": 8000}, "spec.gateway.kvEvents.port", PORT_RULE),
    ({"port": 8001}, "spec.gateway.kvEvents.port", PORT_RULE),
    ({"replayPort": 8000}, "spec.gateway.kvEvents.replayPort", REPLAY_PORT_RULE),
    ({"replayPort": 5557}, "spec.gateway.kvEvents.replayPort", DISTINCT_PORTS_RULE),
]
SCHEMA_CASES = [
    ({"port": 1023}, "spec.gateway.kvEvents.port"),
    ({"port": 65536}, "spec.gateway.kvEvents.port"),
    ({"replayPort": 0}, "spec.gateway.kvEvents.replayPort"),
    ({"bufferSteps": 0}, "spec.gateway.kvEvents.bufferSteps"),
    ({"topic": "t" * 257}, "spec.gateway.kvEvents.topic"),
    ({"enabled": "yes"}, "spec.gateway.kvEvents.enabled"),
]


def _apply(cluster: Cluster, namespace: str, spec: dict[str, Any], name: str = "bad") -> Any:
    body = llmserver(name, {"model": {"source": "/models/m"}, **spec})
    return cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False
    )


@pytest.mark.parametrize(("events", "field", "rule"), CEL_CASES, ids=[str(c[0]) for c in CEL_CASES])
def test_a_port_the_pod_uses_is_refused_naming_the_field(
    cluster: Cluster,
    namespace: str,
    llmserver_crd: Path,
    events: dict[str, Any],
    field: str,
    rule: dict[str, str],
) -> None:
    result = _apply(cluster, namespace, {"gateway": {"kvEvents": {"enabled": True, **events}}})
    assert result.returncode != 0
    assert f"{field}: Invalid value" in result.stderr
    assert rule["message"] in result.stderr


@pytest.mark.parametrize(("events", "field"), SCHEMA_CASES, ids=[c[1] for c in SCHEMA_CASES])
def test_schema_bounds_refuse_with_the_field_named(
    cluster: Cluster, namespace: str, llmserver_crd: Path, events: dict[str, Any], field: str
) -> None:
    result = _apply(cluster, namespace, {"gateway": {"kvEvents": events}})
    assert result.returncode != 0
    assert f"{field}: " in result.stderr


def test_events_without_the_prefix_cache_are_refused(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    spec = {
        "memoryPolicy": {"enablePrefixCaching": False},
        "gateway": {"kvEvents": {"enabled": True}},
    }
    result = _apply(cluster, namespace, spec)
    assert result.returncode != 0
    assert "spec.gateway.kvEvents.enabled: Invalid value" in result.stderr
    assert PREFIX_CACHE_RULE["message"] in result.stderr
    spec["gateway"] = {"kvEvents": {"enabled": False}}
    assert _apply(cluster, namespace, spec, name="off").returncode == 0


def test_good_events_are_stored_with_defaults(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    events = {"enabled": True, "replayPort": 5558, "topic": "kv@$(POD_IP)@m"}
    ok = _apply(cluster, namespace, {"gateway": {"kvEvents": events}}, name="events")
    assert ok.returncode == 0, ok.stderr
    plain = _apply(cluster, namespace, {}, name="plain")
    assert plain.returncode == 0, plain.stderr
    stored = {
        name: yaml.safe_load(
            cluster.kubectl("get", "llms", name, "-n", namespace, "-o", "yaml").stdout
        )["spec"]["gateway"]
        for name in ("events", "plain")
    }
    assert stored["events"] == {
        "kvEvents": {**events, "port": 5557, "bufferSteps": 10000},
    }
    assert stored["plain"] == {
        "kvEvents": {"enabled": False, "port": 5557, "topic": "", "bufferSteps": 10000},
    }
