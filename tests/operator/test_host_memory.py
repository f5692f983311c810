"""The pod's host memory from its server: the plan's inputs, the memory request and limit the
pod gets, the candidate node, and PolicyFits when the pod cannot hold it."""

from __future__ import annotations

from typing import Any

import pytest

from pagekeeper_memplan.budget import GiB, MiB
from pagekeeper_memplan.host import HostInputs, plan_host
from pagekeeper_operator.policy.effective import effective_memory_policy
from pagekeeper_operator.policy.fit import decide_fit, host_candidates
from pagekeeper_operator.policy.host_memory import (
    host_inputs,
    memory_quantities,
    most_allocatable,
    pod_memory,
)
from pagekeeper_operator.render import render_deployment
from tests.operator.servers import DEFAULT_IMAGES, make_server

TIER = {"parallelism": {"tensor": 2}, "memoryPolicy": {"kvOffload": {"size": "32Gi"}}}
LABELS = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"}


def node(name: str, memory: str | None, **labels: str) -> dict[str, Any]:
    status = {} if memory is None else {"allocatable": {"memory": memory, "cpu": "64"}}
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def _resources(spec: dict[str, Any]) -> dict[str, Any]:
    deployment = render_deployment(make_server(spec), DEFAULT_IMAGES)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    resources: dict[str, Any] = container["resources"]
    return resources


def test_the_inputs_of_a_server() -> None:
    spec = {
        "parallelism": {"tensor": 2},
        "resources": {"sharedMemory": "4Gi"},
        "memoryPolicy": {
            "kvOffload": {"size": "1536Mi"},
            "swapSpaceGiB": 2.5,
            "weights": {"cpuOffloadGiB": 1},
        },
    }
    server = make_server(spec)
    assert host_inputs(server, effective_memory_policy(server)) == HostInputs(
        tp=2,
        num_front_ends=1,
        kv_offload_bytes=1536 * MiB,
        swap_bytes_per_rank=2560 * MiB,
        cpu_offload_bytes_per_gpu=GiB,
        shared_memory_bytes=4 * GiB,
    )


def test_a_tier_sets_the_pods_memory_request_and_limit() -> None:
    # 32 GiB tier + 2 x 3 GiB GPU processes + 1 GiB front end + 2 GiB /dev/shm (1Gi a GPU)
    assert _resources(TIER) == {
        "requests": {"memory": "41Gi"},
        "limits": {"nvidia.com/gpu": "2", "memory": "41Gi"},
    }


def test_the_spec_keeps_what_it_sets_and_the_other_follows() -> None:
    both = {"requests": {"memory": "48Gi"}, "limits": {"memory": "64Gi"}}
    assert _resources({**TIER, "resources": both}) == {
        "requests": {"memory": "48Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    # A request above the plan: the limit is at least the request.
    request_only = _resources({**TIER, "resources": {"requests": {"memory": "50Gi"}}})
    assert request_only == {
        "requests": {"memory": "50Gi"},
        "limits": {"nvidia.com/gpu": "2", "memory": "50Gi"},
    }
    # A limit below the plan: the request is the limit (and PolicyFits says it is short).
    limit_only = _resources({**TIER, "resources": {"limits": {"memory": "40Gi"}}})
    assert limit_only == {
        "requests": {"memory": "40Gi"},
        "limits": {"memory": "40Gi", "nvidia.com/gpu": "2"},
    }


@pytest.mark.parametrize(
    "policy",
    [
        {"swapSpaceGiB": 4},
        {"weights": {"cpuOffloadGiB": 4}},
        {"kvOffload": {"size": "4Gi"}},
    ],
)
def test_each_pinned_term_sets_the_memory(policy: dict[str, Any]) -> None:
    server = make_server({"memoryPolicy": policy})
    quantities = memory_quantities(server, effective_memory_policy(server))
    # 4 GiB pinned + 3 GiB core + 1 GiB front end + 1 GiB /dev/shm
    assert quantities == {"requests": "9Gi", "limits": "9Gi"}


def test_the_memory_is_written_as_the_api_server_writes_it() -> None:
    """Whole MiB, rounded up, in the largest binary suffix that keeps an integer."""
    tier = {"memoryPolicy": {"kvOffload": {"size": "1000000000"}}}  # 953.67 MiB, rounded up
    server = make_server(tier)
    assert memory_quantities(server, effective_memory_policy(server)) == {
        "requests": "6074Mi",  # 954 MiB + 5 GiB
        "limits": "6074Mi",
    }
    server = make_server({"memoryPolicy": {"kvOffload": {"size": "1019Gi"}}})
    assert memory_quantities(server, effective_memory_policy(server))["limits"] == "1Ti"


def test_nothing_pinned_leaves_the_pods_resources_as_the_spec_has_them() -> None:
    """So servers that pin no host memory keep their pods across an operator upgrade."""
    assert _resources({}) == {"limits": {"nvidia.com/gpu": "1"}}
    server = make_server()
    memory = pod_memory(server, plan_host(host_inputs(server, server.spec.memory_policy)))
    assert (memory.request, memory.limit, memory.is_planned) == (None, None, False)


def test_the_candidate_with_the_most_allocatable_memory() -> None:
    nodes = [
        node("gpu-a", "500Gi", **LABELS),
        node("gpu-b", "1000Gi", **LABELS),
        node("cpu-a", "2000Gi"),  # no GPU: not a candidate of a GPU server
        node("gpu-c", None, **LABELS),  # reports none
        node("gpu-d", "3000Gi", pool="other", **LABELS),  # the nodeSelector leaves it out
    ]
    server = make_server({"podTemplate": {"nodeSelector": {"pool": "main"}}})
    in_pool = [{**n, "metadata": {**n["metadata"], "labels": {**n["metadata"]["labels"],
               "pool": "main"}}} for n in nodes[:4]]  # fmt: skip
    candidates = host_candidates(server, [*in_pool, nodes[4]])
    assert [n["metadata"]["name"] for n in candidates] == ["gpu-a", "gpu-b", "gpu-c"]
    assert most_allocatable(candidates) == (1000 * GiB, "gpu-b")
    assert most_allocatable([node("x", None)]) is None
    cpu_server = make_server({"resources": {"gpus": 0}})
    assert len(host_candidates(cpu_server, nodes)) == 5


def test_a_tier_no_candidate_node_holds_does_not_fit_and_holds_the_rollout() -> None:
    spec = {**TIER, "memoryPolicy": {"kvOffload": {"size": "600Gi"}}}
    server = make_server(spec)
    fit = decide_fit(server, effective_memory_policy(server), [node("gpu-a", "512Gi", **LABELS)])
    assert fit.holds_rollout
    status, reason, message = fit.condition
    assert (status, reason) == ("False", "HostMemoryExceedsNodes")
    assert message == (
        "the pod needs 609.00 GiB of host memory (kvOffload 600.00 GiB, processes 7.00 GiB, "
        "sharedMemory 2.00 GiB), more than the 512.00 GiB allocatable on any candidate node "
        "(the most: node gpu-a); the rollout is held (running pods keep their template)"
    )
    plan = fit.status
    assert (plan.state, plan.term, plan.shortfall) == ("DoesNotFit", "kvOffload", 97 * GiB)
    assert plan.host is not None
    assert plan.host.to_api() == {
        "perPod": {
            "kvOffload": 600 * GiB,
            "swapSpace": 0,
            "cpuOffload": 0,
            "sharedMemory": 2 * GiB,
            "processes": 7 * GiB,
        },
        "total": 609 * GiB,
        "memoryRequest": 609 * GiB,
        "memoryLimit": 609 * GiB,
        "nodeAllocatable": 512 * GiB,
        "node": "gpu-a",
    }
    # The GPU plan still ran: its terms are in status beside the host's.
    assert plan.per_rank is not None and plan.gpu == "NVIDIA-H100-80GB-HBM3"


def test_the_gpu_verdict_comes_first_and_a_fitting_host_changes_nothing() -> None:
    big = {"model": {"source": "/models/Llama-3.1-70B-Instruct"}, **TIER}
    server = make_server({**big, "parallelism": {"tensor": 1}})
    tiny_node = [node("gpu-a", "16Gi", **LABELS)]
    fit = decide_fit(server, effective_memory_policy(server), tiny_node)
    assert fit.condition[1] == "WeightsExceedGPU"
    server = make_server(TIER)
    fit = decide_fit(server, effective_memory_policy(server), [node("gpu-a", "1Ti", **LABELS)])
    assert fit.condition[:2] == ("True", "Fits")
    assert fit.status.host is not None and fit.status.host.node_allocatable == 1024 * GiB


def test_a_limit_below_the_plan_does_not_fit_even_where_the_gpu_is_unknown() -> None:
    spec = {**TIER, "resources": {"limits": {"memory": "40Gi"}}}
    server = make_server(spec)
    fit = decide_fit(server, effective_memory_policy(server), None)
    assert fit.condition[:2] == ("False", "MemoryLimitBelowHostPlan")
    assert (fit.status.state, fit.status.shortfall) == ("DoesNotFit", 1 * GiB)
    # Without the tier the same spec pins nothing: Unknown, as before.
    plain = make_server({"resources": {"limits": {"memory": "4Gi"}}})
    assert decide_fit(plain, effective_memory_policy(plain), None).status.state == "Unknown"
