"""A KV-aware router reaches the event ports: the pods the operator renders with both ports
pass the API server's validation, and the chart's engine NetworkPolicy opens those ports, by
the names the pods give them, to the router's pods alone (networkPolicy.engine.kvEventsRouter).
Off, the policy is the one `test_helm_chart.check_network_policies` pins: no event ports."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from harness.cluster import Cluster
from pagekeeper_operator.render import render_deployment
from pagekeeper_operator.render.kv_events import EVENTS_PORT_NAME, REPLAY_PORT_NAME
from tests.integration import test_helm_chart
from tests.integration.test_helm_chart import (
    NETWORK_OPTIONS,
    by_kind,
    dry_run,
    namespaces_peer,
    render,
)
from tests.operator.servers import DEFAULT_IMAGES, make_server

kube_version = test_helm_chart.kube_version
other_namespace = test_helm_chart.other_namespace

EVENTS = {"enabled": True, "replayPort": 5558}
ROUTER_PODS = {"app.kubernetes.io/name": "llm-d-inference-scheduler"}


def _deployment(namespace: str, runtime: str = "pagekeeper") -> dict[str, Any]:
    server = make_server({"runtime": runtime, "gateway": {"kvEvents": EVENTS}})
    server = server.model_copy(
        update={"metadata": server.metadata.model_copy(update={"namespace": namespace})}
    )
    return render_deployment(server, DEFAULT_IMAGES)


@pytest.mark.parametrize("runtime", ["pagekeeper", "vllm"])
def test_a_pod_with_both_event_ports_is_accepted(
    cluster: Cluster, namespace: str, runtime: str
) -> None:
    """Container port names are IANA service names, at most 15 characters."""
    deployment = _deployment(namespace, runtime)
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in ports][-2:] == [EVENTS_PORT_NAME, REPLAY_PORT_NAME]
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-",
        input=yaml.safe_dump(deployment), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("labels", "router_pods"),
    [(ROUTER_PODS, ROUTER_PODS), ({}, None)],  # {}: every pod of the router's namespaces
    ids=["labels", "whole-namespace"],
)
def test_the_engine_policy_opens_the_event_ports_to_the_router(
    cluster: Cluster,
    namespace: str,
    other_namespace: str,
    kube_version: str,
    labels: dict[str, str],
    router_pods: dict[str, str] | None,
) -> None:
    docs = render(
        cluster, kube_version, namespace, *NETWORK_OPTIONS,
        "--set", f"networkPolicy.engine.namespaces={{{other_namespace}}}",
        "--set", "networkPolicy.engine.kvEventsRouter.enabled=true",
        "--set", "networkPolicy.engine.kvEventsRouter.namespaces={gateway}",
        "--set-json", f"networkPolicy.engine.kvEventsRouter.podLabels={json.dumps(labels)}",
    )  # fmt: skip
    _, engines = by_kind(docs, "NetworkPolicy")
    assert engines["metadata"]["namespace"] == other_namespace
    http, launcher, events = engines["spec"]["ingress"]
    # The OpenAI and launcher ports' rules are the ones without a router.
    assert [port["port"] for rule in (http, launcher) for port in rule["ports"]] == [8000, 8001]
    router = namespaces_peer(other_namespace, "gateway")
    if router_pods is not None:
        router["podSelector"] = {"matchLabels": router_pods}
    assert events == {
        "from": [router],
        "ports": [
            {"protocol": "TCP", "port": EVENTS_PORT_NAME},
            {"protocol": "TCP", "port": REPLAY_PORT_NAME},
        ],
    }
    # The names are the ones the operator's pods give their event ports.
    deployment = _deployment(other_namespace)
    pod_ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {p["port"] for p in events["ports"]} <= {p["name"] for p in pod_ports}
    dry_run(cluster, [engines, deployment])
