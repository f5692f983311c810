"""The InferencePool of an LLMServer on the real control plane, against the CRD of the Gateway
API Inference Extension's Go module: rendered, applied, owned, pruned and garbage-collected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import OperatorProcess
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import render_inference_pool
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_or_none,
    wait_quiet,
    wait_ready,
)

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator
inference_pool_crd = operator_fixture.inference_pool_crd
no_inference_pool_crd = operator_fixture.no_inference_pool_crd

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
BASE: dict[str, Any] = {"model": {"source": "/models/m"}, "replicas": 2, "resources": {"gpus": 1}}
POOL = {"inferencePool": {"endpointPickerRef": {"name": "chat-epp", "failureMode": "FailOpen"}}}


def _pool(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    custom = client.CustomObjectsApi(cluster.api)
    pool: dict[str, Any] | None = get_or_none(
        custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
    )
    return pool


def test_pool_rendered_applied_pruned_and_collected(
    cluster: Cluster,
    namespace: str,
    inference_pool_crd: Path,
    operator: OperatorProcess,
) -> None:
    apply_server(cluster, namespace, llmserver("chat", {**BASE, "gateway": POOL}))
    obj = wait_ready(cluster, namespace, "chat", 2)
    pool = wait_for(lambda: _pool(cluster, namespace, "chat"), what="InferencePool chat")
    server = LLMServer.model_validate(obj)
    assert server.spec.gateway.inference_pool is not None
    expected = render_inference_pool(server, server.spec.gateway.inference_pool)
    # The API server took it as rendered (its schema's defaults come on top).
    assert pool["spec"]["selector"] == expected["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        **expected["spec"]["endpointPickerRef"],
        "group": "",
    }
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "LLMServer",
        obj["metadata"]["uid"],
        True,
    )
    # It selects exactly the server's pods.
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector)
    assert len(pods.items) == 2
    # Nothing to change: resyncs leave it alone, defaults and all.
    wait_quiet(lambda: str(_pool(cluster, namespace, "chat")["metadata"]["resourceVersion"]))
    # Unset in spec: the operator deletes the pool it made.
    apply_server(cluster, namespace, llmserver("chat", BASE))
    wait_for(lambda: _pool(cluster, namespace, "chat") is None, what="InferencePool pruned")
    # Set again, then the server deleted: the garbage collector takes the pool with it.
    apply_server(cluster, namespace, llmserver("chat", {**BASE, "gateway": POOL}))
    wait_for(lambda: _pool(cluster, namespace, "chat"), what="InferencePool back")
    cluster.kubectl("delete", "llmserver", "chat", "-n", namespace, "--wait=false")
    wait_for(
        lambda: _pool(cluster, namespace, "chat") is None,
        timeout=120,
        what="InferencePool garbage-collected",
    )


def test_without_the_crd_nothing_is_rendered_and_nothing_fails(
    cluster: Cluster,
    namespace: str,
    no_inference_pool_crd: None,
    operator: OperatorProcess,
) -> None:
    apply_server(cluster, namespace, llmserver("chat", {**BASE, "gateway": POOL}))
    obj = wait_ready(cluster, namespace, "chat", 2)
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "False"
    operator.wait_for_log("CRD inferencepools.inference.networking.k8s.io is absent")
    assert "inferencepools" not in cluster.kubectl("api-resources", "-o", "name").stdout
