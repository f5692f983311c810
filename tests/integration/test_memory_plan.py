"""The memory plan on the real control plane: a 70B that cannot fit an 80 GB GPU is refused
before any pod starts, and planned and rolled out once split over four GPUs or quantized; a
change that stops fitting leaves the running pods alone."""

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

NAME = "llama-70b"
# kwok-gpu-0 (hack/nodes.yaml) is labelled as feature discovery labels an H100 80GB node.
SPEC: dict[str, Any] = {
    "model": {"source": "/models/Llama-3.1-70B-Instruct"},
    "resources": {"gpuType": "NVIDIA-H100-80GB-HBM3"},
    "memoryPolicy": {"maxModelLen": 32768},
}


def _plan_state(cluster: Cluster, namespace: str, state: str) -> dict[str, Any] | None:
    obj = get_server(cluster, namespace, NAME)
    status = obj.get("status", {})
    if status.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    plan = status.get("memoryPlan") or {}
    return obj if plan.get("state") == state else None


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def _deployment(cluster: Cluster, namespace: str) -> Any:
    apps = client.AppsV1Api(cluster.api)
    return get_or_none(apps.read_namespaced_deployment, NAME, namespace)


def test_a_70b_that_cannot_fit_is_refused_then_planned_at_tensor_4(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver(NAME, SPEC))
    obj = wait_for(
        lambda: _plan_state(cluster, namespace, "DoesNotFit"), timeout=60, what="DoesNotFit"
    )
    fits = _condition(obj, "PolicyFits")
    assert (fits["status"], fits["reason"]) == ("False", "WeightsExceedGPU")
    assert fits["message"].startswith("weights alone take 131.43 GiB a rank at tensor 1")
    plan = obj["status"]["memoryPlan"]
    assert (plan["gpu"], plan["gpuMemory"], plan["term"]) == (
        "NVIDIA-H100-80GB-HBM3",
        81559 << 20,
        "weights",
    )
    assert plan["gpuSource"].endswith("(node kwok-gpu-0)")
    assert _deployment(cluster, namespace) is None  # no pod ever starts
    events = client.CoreV1Api(cluster.api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME}"
    )
    assert "PolicyDoesNotFit" in {e.reason for e in events.items}
    columns = cluster.kubectl("get", "llms", NAME, "-n", namespace).stdout
    assert "FITS" in columns.splitlines()[0] and "DoesNotFit" in columns

    # Four GPUs: planned, rolled out.
    apply_server(cluster, namespace, llmserver(NAME, {**SPEC, "parallelism": {"tensor": 4}}))
    wait_for(lambda: _plan_state(cluster, namespace, "Fits"), timeout=60, what="Fits")
    obj = wait_ready(cluster, namespace, NAME, 1)
    assert _condition(obj, "PolicyFits")["status"] == "True"
    assert obj["status"]["memoryPlan"]["maxConcurrentSequences"] >= 1
    template = _deployment(cluster, namespace).spec.template

    # Back to one GPU: refused again, and the running pods keep their template.
    apply_server(cluster, namespace, llmserver(NAME, SPEC))
    wait_for(lambda: _plan_state(cluster, namespace, "DoesNotFit"), timeout=60, what="held")
    held = _deployment(cluster, namespace).spec.template
    assert held.spec.containers[0].command == template.spec.containers[0].command
    assert held.metadata.annotations == template.metadata.annotations


def test_fp8_weights_at_tensor_2_are_planned_and_rolled_out(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {
        **SPEC,
        "parallelism": {"tensor": 2},
        "memoryPolicy": {"maxModelLen": 32768, "weights": {"quantization": "fp8"}},
    }
    apply_server(cluster, namespace, llmserver(NAME, spec))
    obj = wait_for(lambda: _plan_state(cluster, namespace, "Fits"), timeout=60, what="Fits")
    assert _condition(obj, "PolicyFits")["reason"] == "Fits"
    wait_ready(cluster, namespace, NAME, 1)
    command = _deployment(cluster, namespace).spec.template.spec.containers[0].command
    assert command[command.index("--quantization") + 1] == "fp8"


def test_a_host_tier_no_node_holds_is_refused_then_rolled_out_with_its_memory(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The host side of the plan: kwok-gpu-0's 512Gi allocatable (hack/nodes.yaml) cannot hold
    a 600Gi tier; a 32Gi one rolls out with the pod's memory request and limit from the plan."""
    fitting = {**SPEC, "parallelism": {"tensor": 4}}
    big = {**fitting, "memoryPolicy": {"maxModelLen": 32768, "kvOffload": {"size": "600Gi"}}}
    apply_server(cluster, namespace, llmserver(NAME, big))
    obj = wait_for(
        lambda: _plan_state(cluster, namespace, "DoesNotFit"), timeout=60, what="DoesNotFit"
    )
    fits = _condition(obj, "PolicyFits")
    assert (fits["status"], fits["reason"]) == ("False", "HostMemoryExceedsNodes")
    assert fits["message"].startswith(
        "the pod needs 617.00 GiB of host memory (kvOffload 600.00 GiB, processes 13.00 GiB, "
        "sharedMemory 4.00 GiB), more than the 512.00 GiB allocatable on any candidate node "
        "(the most: node kwok-gpu-0)"
    )
    host = obj["status"]["memoryPlan"]["host"]
    assert (host["total"], host["nodeAllocatable"], host["node"]) == (
        617 << 30,
        512 << 30,
        "kwok-gpu-0",
    )
    assert obj["status"]["memoryPlan"]["term"] == "kvOffload"
    assert _deployment(cluster, namespace) is None

    small = {**fitting, "memoryPolicy": {"maxModelLen": 32768, "kvOffload": {"size": "32Gi"}}}
    apply_server(cluster, namespace, llmserver(NAME, small))
    wait_for(lambda: _plan_state(cluster, namespace, "Fits"), timeout=60, what="Fits")
    wait_ready(cluster, namespace, NAME, 1)
    container = _deployment(cluster, namespace).spec.template.spec.containers[0]
    # 32 GiB tier + 4 x 3 GiB GPU processes + 1 GiB front end + 4 GiB /dev/shm
    assert container.resources.requests == {"memory": "49Gi"}
    assert container.resources.limits == {"memory": "49Gi", "nvidia.com/gpu": "4"}
    command = container.command
    assert command[command.index("--kv-offloading-size") + 1] == "32"
