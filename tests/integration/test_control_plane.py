"""Smoke tests: the local control plane behaves like a real cluster where pagekeeper needs it."""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, wait_for

pytestmark = pytest.mark.integration

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.pagekeeper.dev"},
    "spec": {
        "group": "smoke.pagekeeper.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"size": {"type": "integer", "minimum": 1}},
                            }
                        },
                    }
                },
            }
        ],
    },
}


def _labels(name: str) -> dict[str, str]:
    return {"app": name}


def _deployment(name: str, replicas: int, resources: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _labels(name)},
            "template": {
                "metadata": {"labels": _labels(name)},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "example.invalid/engine:1",
                            "resources": resources,
                        }
                    ]
                },
            },
        },
    }


def test_crd_becomes_established_and_validates(cluster: Cluster, namespace: str) -> None:
    cluster.apply_yaml(WIDGET_CRD)
    cluster.wait_established("widgets.smoke.pagekeeper.dev")
    ok = {
        "apiVersion": "smoke.pagekeeper.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": namespace},
        "spec": {"size": 2},
    }
    cluster.apply_yaml(ok)
    bad = {**ok, "metadata": {"name": "w2", "namespace": namespace}, "spec": {"size": 0}}
    result = cluster.kubectl("apply", "-f", "-", input=_dump(bad), check=False)
    assert result.returncode != 0
    assert "spec.size" in result.stderr


def test_gpu_deployment_becomes_ready_on_a_kwok_gpu_node(cluster: Cluster, namespace: str) -> None:
    gpu = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "1", "memory": "1Gi"}}
    cluster.apply_yaml(_deployment("gpu", 2, gpu), "-n", namespace)
    cluster.kubectl("rollout", "status", "deployment/gpu", "-n", namespace, "--timeout=90s")
    core = client.CoreV1Api(cluster.api)
    pods = core.list_namespaced_pod(namespace, label_selector="app=gpu").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.spec.node_name in {"kwok-gpu-0", "kwok-gpu-1"}
        ready = {c.type: c.status for c in pod.status.conditions}
        assert ready["Ready"] == "True"


def test_unsatisfiable_gpu_request_stays_pending(cluster: Cluster, namespace: str) -> None:
    too_many = {"limits": {"nvidia.com/gpu": "9"}}
    cluster.apply_yaml(_deployment("greedy", 1, too_many), "-n", namespace)
    core = client.CoreV1Api(cluster.api)

    def unschedulable() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector="app=greedy").items
        return bool(pods) and any(
            c.type == "PodScheduled" and c.reason == "Unschedulable"
            for c in (pods[0].status.conditions or [])
        )

    wait_for(unschedulable, timeout=60, what="the 9-GPU pod to be reported Unschedulable")


def test_eviction_respects_pod_disruption_budget(cluster: Cluster, namespace: str) -> None:
    cluster.apply_yaml(_deployment("web", 2, {}), "-n", namespace)
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=90s")
    policy = client.PolicyV1Api(cluster.api)
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "web"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": _labels("web")}},
    }
    cluster.apply_yaml(pdb, "-n", namespace)
    wait_for(
        lambda: (
            policy.read_namespaced_pod_disruption_budget(
                "web", namespace
            ).status.observed_generation
            == 1
        ),
        what="the disruption controller to observe the PDB",
    )

    core = client.CoreV1Api(cluster.api)
    pod = core.list_namespaced_pod(namespace, label_selector="app=web").items[0].metadata.name
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=namespace))
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction(pod, namespace, eviction)
    assert refused.value.status == 429
    assert "disruption budget" in refused.value.body

    selector = {"matchLabels": _labels("web")}
    cluster.apply_yaml(
        {**pdb, "spec": {"maxUnavailable": 1, "selector": selector}}, "-n", namespace
    )
    wait_for(
        lambda: (
            (
                policy.read_namespaced_pod_disruption_budget(
                    "web", namespace
                ).status.disruptions_allowed
                or 0
            )
            >= 1
        ),
        what="the PDB to allow one disruption",
    )
    core.create_namespaced_pod_eviction(pod, namespace, eviction)
    wait_for(lambda: _is_gone_or_terminating(core, pod, namespace), what=f"{pod} to be evicted")


def _is_gone_or_terminating(core: client.CoreV1Api, pod: str, namespace: str) -> bool:
    try:
        return core.read_namespaced_pod(pod, namespace).metadata.deletion_timestamp is not None
    except ApiException as exc:
        return exc.status == 404


def test_restricted_namespace_rejects_privileged_pod(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    privileged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root", "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "example.invalid/x:1",
                    "securityContext": {"privileged": True},
                }
            ]
        },
    }
    result = cluster.kubectl("apply", "-f", "-", input=_dump(privileged), check=False)
    assert result.returncode != 0
    assert "violates PodSecurity" in result.stderr
    assert "restricted:latest" in result.stderr


def _dump(doc: dict[str, object]) -> str:
    return yaml.safe_dump(doc)
