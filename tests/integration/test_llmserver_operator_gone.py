"""An LLMServer never depends on the operator to be deleted: it carries no finalizer."""

from __future__ import annotations

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


def test_server_without_finalizer_is_deleted_while_the_operator_is_down(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(
        cluster,
        namespace,
        llmserver("orphan", {"model": {"source": "/m"}, "resources": {"gpus": 1}}),
    )
    wait_ready(cluster, namespace, "orphan", 1)
    assert get_server(cluster, namespace, "orphan")["metadata"].get("finalizers") in (None, [])

    operator.stop()  # uninstalled, crashed or scaled to zero
    cluster.kubectl(
        "delete", "llmserver", "orphan", "-n", namespace, "--wait=true", "--timeout=30s"
    )
    apps = client.AppsV1Api(cluster.api)
    wait_for(
        lambda: get_or_none(apps.read_namespaced_deployment, "orphan", namespace) is None,
        timeout=60,
        what="the Deployment garbage-collected without the operator",
    )
