"""Counting writes: a restarted operator resumes without any, and a second server-side apply
manager conflicts with ours only on the fields we own."""

from __future__ import annotations

from typing import Any

import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import RESYNC_SECONDS, OperatorProcess
from pagekeeper_operator.adapters.plan import stamp
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.resync import RESYNC_DONE
from pagekeeper_operator.render import ClusterFeatures, render_all
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_server,
    wait_quiet,
    wait_ready,
)

# Fixtures shared by the LLMServer integration tests.
llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

SPEC: dict[str, Any] = {"model": {"source": "/models/m"}, "resources": {"gpus": 1}}
IMAGES = {
    "pagekeeper": "ghcr.io/pagekeeper-dev/pagekeeper-engine:0.1.0",
    "vllm": "docker.io/vllm/vllm-openai:v0.11.0",
}


def _versions(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    policy, custom = client.PolicyV1Api(cluster.api), client.CustomObjectsApi(cluster.api)
    return {
        "llmserver": get_server(cluster, namespace, name)["metadata"]["resourceVersion"],
        "deployment": apps.read_namespaced_deployment(name, namespace).metadata.resource_version,
        "service": core.read_namespaced_service(name, namespace).metadata.resource_version,
        "pdb": policy.read_namespaced_pod_disruption_budget(
            name, namespace
        ).metadata.resource_version,
        "servicemonitor": custom.get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "servicemonitors", name
        )["metadata"]["resourceVersion"],
        "prometheusrule": custom.get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "prometheusrules", f"{name}-memory-alerts"
        )["metadata"]["resourceVersion"],
    }


def _quiet_versions(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    wait_quiet(lambda: "/".join(_versions(cluster, namespace, name).values()), seconds=4)
    return _versions(cluster, namespace, name)


def test_restarted_operator_resumes_without_writes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver("m", SPEC))
    wait_ready(cluster, namespace, "m", 1)
    before = _quiet_versions(cluster, namespace, "m")

    operator.stop()
    operator.start()
    operator.wait_for_log("Resuming is processed: 1 succeeded")
    operator.wait_for_log(RESYNC_DONE, timeout=RESYNC_SECONDS * 4)
    assert "reconciled generation 1: 0 applied, status unchanged" in operator.log()
    assert _versions(cluster, namespace, "m") == before

    # A change made while the operator is down is applied once when it comes back.
    generation = (
        client.AppsV1Api(cluster.api).read_namespaced_deployment("m", namespace).metadata.generation
    )
    operator.stop()
    apply_server(cluster, namespace, llmserver("m", {**SPEC, "memoryPolicy": {"blockSize": 32}}))
    operator.start()
    wait_ready(cluster, namespace, "m", 1)
    deployment = client.AppsV1Api(cluster.api).read_namespaced_deployment("m", namespace)
    assert deployment.metadata.generation == generation + 1
    command = deployment.spec.template.spec.containers[0].command
    assert command[command.index("--block-size") + 1] == "32"
    assert operator.log().count("applied Deployment/m (changed)") == 1


def test_second_manager_conflicts_only_on_our_fields(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver("m", SPEC))
    obj = wait_ready(cluster, namespace, "m", 1)
    server = LLMServer.model_validate(obj)
    rendered = [stamp(m) for m in render_all(server, IMAGES, ClusterFeatures(True, True))]
    apps = client.AppsV1Api(cluster.api)
    generation = apps.read_namespaced_deployment("m", namespace).metadata.generation

    # The same values under another manager: shared ownership, no conflict, and no change
    # beyond managedFields (the Deployment's generation stays: no rollout).
    same = cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager",
        "other",
        "-f",
        "-",
        input=yaml.safe_dump_all(rendered),
        check=False,
    )
    assert same.returncode == 0, same.stderr
    assert apps.read_namespaced_deployment("m", namespace).metadata.generation == generation

    # A field we do not own: no conflict, and the operator leaves it alone.
    deployment = next(m for m in rendered if m["kind"] == "Deployment")
    extra = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "m", "namespace": namespace, "labels": {"team": "search"}},
    }
    added = cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager",
        "third",
        "-f",
        "-",
        input=yaml.safe_dump(extra),
        check=False,
    )
    assert added.returncode == 0, added.stderr

    # A different value in a field we own: a conflict naming our manager and only that field.
    changed = {**deployment, "spec": {**deployment["spec"], "replicas": 3}}
    conflict = cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager",
        "other",
        "-f",
        "-",
        input=yaml.safe_dump(changed),
        check=False,
    )
    assert conflict.returncode != 0
    assert 'conflict with "pagekeeper-operator"' in conflict.stderr
    assert ".spec.replicas" in conflict.stderr
    assert conflict.stderr.count("conflict with") == 1

    # The operator's resyncs see nothing of ours changed: they write nothing at all.
    before = _quiet_versions(cluster, namespace, "m")
    num_resyncs = operator.log().count(RESYNC_DONE)
    wait_for(
        lambda: operator.log().count(RESYNC_DONE) >= num_resyncs + 2,
        timeout=RESYNC_SECONDS * 6,
        what="two more resyncs",
    )
    assert _versions(cluster, namespace, "m") == before
    assert "(drifted)" not in operator.log() and "(changed)" not in operator.log()
    live = apps.read_namespaced_deployment("m", namespace)
    assert live.metadata.labels["team"] == "search"
    assert live.metadata.generation == generation
    managers = {f.manager for f in live.metadata.managed_fields}
    assert {"pagekeeper-operator", "other", "third"} <= managers
