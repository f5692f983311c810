"""The API server itself refuses bad LLMServers: schema bounds and one spec per CEL rule, on
create and on an update of a running server (which nothing then disturbs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import RESYNC_SECONDS, OperatorProcess
from pagekeeper_operator.api.pod import ENV_RULE
from pagekeeper_operator.api.policy import (
    BATCHED_TOKENS_RULE,
    BUDGETS_RULE,
    KV_CACHE_MEMORY_RULE,
    KV_OFFLOAD_BACKEND_RULE,
    KV_OFFLOAD_PREFIX_RULE,
    KV_OFFLOAD_SIZE_RULE,
    NUM_SEQS_RULE,
    SPLIT_SIZE_RULE,
)
from pagekeeper_operator.api.rollout import ROLLOUT_RULE
from pagekeeper_operator.api.spec_rules import (
    ADAPTIVE_FLOOR_RULE,
    BLOCK_SIZE_RULE,
    CANARY_CAPACITY_RULE,
    DRAIN_RULE,
    GPU_RULE,
    OFFLOAD_MEMORY_RULE,
    PYTHONPATH_RULE,
    SWAP_RULE,
)
from pagekeeper_operator.api.tuning import APPLY_RULE, BOUNDS_RULES, ITL_RULE, TTFT_RULE
from pagekeeper_operator.controllers.resync import RESYNC_DONE
from pagekeeper_operator.render.meta import SERVER_LABEL
from tests.integration import operator_fixture
from tests.integration.operator_fixture import apply_server, get_server, wait_ready
from tests.operator.servers import merge

# Fixtures shared by the LLMServer integration tests.
llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

CEL_CASES = [
    (
        {"memoryPolicy": {"enableChunkedPrefill": False, "maxModelLen": 9000}},
        "spec.memoryPolicy.maxNumBatchedTokens",
        BATCHED_TOKENS_RULE,
    ),
    (
        {"memoryPolicy": {"maxNumSeqs": 300, "maxNumBatchedTokens": 256}},
        "spec.memoryPolicy.maxNumSeqs",
        NUM_SEQS_RULE,
    ),
    (
        {"runtime": "vllm", "memoryPolicy": {"swapSpaceGiB": 4}},
        "spec.memoryPolicy.swapSpaceGiB",
        SWAP_RULE,
    ),
    (
        {"memoryPolicy": {"allocator": {"maxSplitSizeMb": 512}}},
        "spec.memoryPolicy.allocator.maxSplitSizeMb",
        SPLIT_SIZE_RULE,
    ),
    (
        {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
        "spec.rollout.maxUnavailable",
        ROLLOUT_RULE,
    ),
    (
        {"podTemplate": {"env": [{"name": "PYTORCH_ALLOC_CONF", "value": "x"}]}},
        "spec.podTemplate.env",
        ENV_RULE,
    ),
    (
        {"runtime": "vllm", "memoryPolicy": {"blockSize": 8}},
        "spec.memoryPolicy.blockSize",
        BLOCK_SIZE_RULE,
    ),
    (
        {
            "memoryPolicy": {"gpuMemoryUtilization": 0.8},
            "remediation": {"adaptive": {"minGpuMemoryUtilization": 0.85}},
        },
        "spec.remediation.adaptive.minGpuMemoryUtilization",
        ADAPTIVE_FLOOR_RULE,
    ),
    (
        {"shutdownGracePeriodSeconds": 20, "remediation": {"drainTimeoutSeconds": 60}},
        "spec.shutdownGracePeriodSeconds",
        DRAIN_RULE,
    ),
    (
        {
            "runtime": "vllm",
            "podTemplate": {
                "env": [
                    {
                        "name": "PYTHONPATH",
                        "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                    }
                ]
            },
        },
        "spec.podTemplate.env",
        PYTHONPATH_RULE,
    ),
    (
        {"parallelism": {"tensor": 4}, "resources": {"gpus": 2}},
        "spec.resources.gpus",
        GPU_RULE,
    ),
    (
        {"parallelism": {"tensor": 2}, "resources": {"gpus": 0}},
        "spec.resources.gpus",
        GPU_RULE,
    ),
    (
        {"memoryPolicy": {"gpuMemoryUtilization": 0.8, "kvCacheMemory": "20Gi"}},
        "spec.memoryPolicy.kvCacheMemory",
        BUDGETS_RULE,
    ),
    (
        {"memoryPolicy": {"kvCacheMemory": "0"}},
        "spec.memoryPolicy.kvCacheMemory",
        KV_CACHE_MEMORY_RULE,
    ),
    (
        {
            "parallelism": {"tensor": 2},
            "resources": {"requests": {"memory": "16Gi"}},
            "memoryPolicy": {"weights": {"cpuOffloadGiB": 10}},
        },
        "spec.memoryPolicy.weights.cpuOffloadGiB",
        OFFLOAD_MEMORY_RULE,
    ),
    (
        {"memoryPolicy": {"kvOffload": {"size": "0Gi"}}},
        "spec.memoryPolicy.kvOffload.size",
        KV_OFFLOAD_SIZE_RULE,
    ),
    (
        {"memoryPolicy": {"kvOffload": {"size": 0}}},
        "spec.memoryPolicy.kvOffload.size",
        KV_OFFLOAD_SIZE_RULE,
    ),
    (
        {"memoryPolicy": {"enablePrefixCaching": False, "kvOffload": {"size": "8Gi"}}},
        "spec.memoryPolicy.kvOffload",
        KV_OFFLOAD_PREFIX_RULE,
    ),
    (
        {"memoryPolicy": {"kvOffload": {"size": "8Gi", "backend": "lmcache"}}},
        "spec.memoryPolicy.kvOffload.backend",
        KV_OFFLOAD_BACKEND_RULE,
    ),
    ({"tuning": {"objective": "ThroughputUnderTTFT"}}, "spec.tuning.ttftP99Seconds", TTFT_RULE),
    ({"tuning": {"objective": "ThroughputUnderITL"}}, "spec.tuning.itlP99Seconds", ITL_RULE),
    (
        {"tuning": {"bounds": {"maxNumSeqs": {"min": 64, "max": 32}}}},
        "spec.tuning.bounds.maxNumSeqs.min",
        BOUNDS_RULES[1],
    ),
    (
        {"tuning": {"bounds": {"gpuMemoryUtilization": {"min": 0.5, "max": 0.8}}}},
        "spec.tuning.bounds.gpuMemoryUtilization",
        BOUNDS_RULES[3],
    ),
    (
        {"tuning": {"bounds": {"blockSizes": [8, 32]}}},
        "spec.tuning.bounds.blockSizes",
        BOUNDS_RULES[6],
    ),
    ({"replicas": 2, "tuning": {"mode": "Apply"}}, "spec.tuning.mode", APPLY_RULE),
    (
        {"replicas": 4, "rollout": {"canary": {"enabled": True, "replicas": 2}}},
        "spec.rollout.canary.replicas",
        CANARY_CAPACITY_RULE,
    ),
]
SCHEMA_CASES = [
    ({"memoryPolicy": {"gpuMemoryUtilization": 0}}, "spec.memoryPolicy.gpuMemoryUtilization"),
    ({"memoryPolicy": {"gpuMemoryUtilization": 0.995}}, "spec.memoryPolicy.gpuMemoryUtilization"),
    ({"memoryPolicy": {"blockSize": 64}}, "spec.memoryPolicy.blockSize"),
    (
        {"memoryPolicy": {"allocator": {"garbageCollectionThreshold": 1}}},
        "spec.memoryPolicy.allocator.garbageCollectionThreshold",
    ),
    ({"memoryPolicy": {"fragmentationBuffer": "plenty"}}, "spec.memoryPolicy.fragmentationBuffer"),
    ({"runtime": "tgi"}, "spec.runtime"),
    ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor"),
    ({"memoryPolicy": {"kvCacheDtype": "fp16"}}, "spec.memoryPolicy.kvCacheDtype"),
    ({"memoryPolicy": {"kvCacheMemory": "lots"}}, "spec.memoryPolicy.kvCacheMemory"),
    (
        {"memoryPolicy": {"weights": {"quantization": "int4"}}},
        "spec.memoryPolicy.weights.quantization",
    ),
    (
        {"memoryPolicy": {"weights": {"cpuOffloadGiB": -1}}},
        "spec.memoryPolicy.weights.cpuOffloadGiB",
    ),
    ({"tuning": {"windowSeconds": -5}}, "spec.tuning.windowSeconds"),
    ({"memoryPolicy": {"kvOffload": {"size": "lots"}}}, "spec.memoryPolicy.kvOffload.size"),
    ({"memoryPolicy": {"kvOffload": {"size": "-8Gi"}}}, "spec.memoryPolicy.kvOffload.size"),
    ({"memoryPolicy": {"kvOffload": {}}}, "spec.memoryPolicy.kvOffload.size"),
    (
        {"memoryPolicy": {"kvOffload": {"size": "8Gi", "backend": "disk"}}},
        "spec.memoryPolicy.kvOffload.backend",
    ),
    # What the pod template copies, under the API server's own rules for pods.
    ({"podTemplate": {"env": [{"name": "A=B", "value": "1"}]}}, "spec.podTemplate.env[0].name"),
    (
        {"podTemplate": {"volumes": [{"name": "Models", "emptyDir": {}}]}},
        "spec.podTemplate.volumes[0].name",
    ),
    ({"podTemplate": {"volumes": [{"emptyDir": {}}]}}, "spec.podTemplate.volumes[0].name"),
    (
        {"podTemplate": {"volumeMounts": [{"name": "m_1", "mountPath": "/m"}]}},
        "spec.podTemplate.volumeMounts[0].name",
    ),
    ({"service": {"port": 70000}}, "spec.service.port"),
    ({"apiKey": {"secretName": "Not_A_Secret"}}, "spec.apiKey.secretName"),
    ({"apiKey": {"secretName": "s", "key": "a key"}}, "spec.apiKey.key"),
    ({"apiKey": {"key": "token"}}, "spec.apiKey.secretName"),
]


def _apply(cluster: Cluster, namespace: str, spec: dict[str, Any], name: str = "bad") -> Any:
    body = llmserver(name, {"model": {"source": "/models/m"}, **spec})
    return cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False
    )


@pytest.mark.parametrize(("spec", "field", "rule"), CEL_CASES, ids=[case[1] for case in CEL_CASES])
def test_each_cel_rule_refuses_with_the_field_named(
    cluster: Cluster,
    namespace: str,
    llmserver_crd: Path,
    spec: dict[str, Any],
    field: str,
    rule: dict[str, str],
) -> None:
    result = _apply(cluster, namespace, spec)
    assert result.returncode != 0
    assert f"{field}: Invalid value" in result.stderr
    assert rule["message"] in result.stderr


@pytest.mark.parametrize(("spec", "field"), SCHEMA_CASES, ids=[c[1] for c in SCHEMA_CASES])
def test_schema_bounds_refuse_with_the_field_named(
    cluster: Cluster, namespace: str, llmserver_crd: Path, spec: dict[str, Any], field: str
) -> None:
    result = _apply(cluster, namespace, spec)
    assert result.returncode != 0
    assert f"{field}: " in result.stderr


def test_valid_specs_are_stored_with_defaults(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    ok = _apply(
        cluster,
        namespace,
        {
            "memoryPolicy": {
                "maxModelLen": 32768,
                "maxNumBatchedTokens": 2048,
                "swapSpaceGiB": 4,
                "allocator": {"expandableSegments": False, "maxSplitSizeMb": 256},
            },
            "resources": {"requests": {"cpu": 4}},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0},
        },
        name="good",
    )
    assert ok.returncode == 0, ok.stderr
    spec = get_server(cluster, namespace, "good")["spec"]
    assert spec["runtime"] == "pagekeeper" and spec["replicas"] == 1
    # No stored utilization: 0.9 applies unless kvCacheMemory replaces it.
    assert "gpuMemoryUtilization" not in spec["memoryPolicy"]
    assert spec["memoryPolicy"]["blockSize"] == 16
    assert spec["resources"]["requests"]["cpu"] == 4
    assert spec["remediation"]["maxUnavailable"] == 1
    assert "enabled" not in spec["remediation"]["triggers"]["fragmentation"]
    assert spec["tuning"]["mode"] == "Recommend"
    explain = cluster.kubectl("explain", "llmserver.spec.tuning.mode")
    assert "Recommend (the default): status.recommendations" in " ".join(explain.stdout.split())
    explain = cluster.kubectl("explain", "llmserver.spec.memoryPolicy.gpuMemoryUtilization")
    assert "the fraction of the GPU's total memory this instance may use" in " ".join(
        explain.stdout.split()
    )


def test_budgets_and_weights_that_fit_the_rules_are_stored(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    """A KV byte budget with the adaptive floor (which then does not apply), and an offload the
    memory request covers; offload beyond the weights is the plan's to refuse, not CEL's."""
    for name, spec in (
        ("kv-budget", {"memoryPolicy": {"kvCacheMemory": "20Gi"}}),
        ("kv-budget-int", {"memoryPolicy": {"kvCacheMemory": 21474836480}}),
        (
            "offload",
            {
                "parallelism": {"tensor": 2},
                "resources": {"requests": {"memory": "20Gi"}},
                "memoryPolicy": {"weights": {"quantization": "fp8", "cpuOffloadGiB": 10}},
            },
        ),
        ("offload-no-request", {"memoryPolicy": {"weights": {"cpuOffloadGiB": 500}}}),
    ):
        result = _apply(cluster, namespace, spec, name=name)
        assert result.returncode == 0, (name, result.stderr)


def test_a_host_kv_tier_is_stored_beside_swap_and_under_either_runtime(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    """The tier and swap are separate host pools (both may be set on the paged engine); vllm
    takes either backend; the backend defaults to native; the size stays as written."""
    for name, spec in (
        ("tier-swap", {"memoryPolicy": {"swapSpaceGiB": 4, "kvOffload": {"size": "32Gi"}}}),
        ("tier-bytes", {"memoryPolicy": {"kvOffload": {"size": 34359738368}}}),
        (
            "tier-lmcache",
            {
                "runtime": "vllm",
                "memoryPolicy": {"kvOffload": {"size": "1536Mi", "backend": "lmcache"}},
            },
        ),
    ):
        result = _apply(cluster, namespace, spec, name=name)
        assert result.returncode == 0, (name, result.stderr)
    stored = get_server(cluster, namespace, "tier-swap")["spec"]["memoryPolicy"]
    assert (stored["kvOffload"], stored["swapSpaceGiB"]) == (
        {"size": "32Gi", "backend": "native"},
        4,
    )
    tier = get_server(cluster, namespace, "tier-lmcache")["spec"]["memoryPolicy"]["kvOffload"]
    assert tier == {"size": "1536Mi", "backend": "lmcache"}
    explain = cluster.kubectl("explain", "llmserver.spec.memoryPolicy.kvOffload.size")
    assert "host memory of the KV tier per pod, total over the tensor-parallel ranks" in " ".join(
        explain.stdout.split()
    )


def test_small_example_passes_a_server_side_dry_run(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "llmserver-small.yaml"
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))
    assert "llmserver.pagekeeper.dev/qwen3-0-6b created (server dry run)" in result.stdout


def test_vllm_accepts_what_it_can_run(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    """Block sizes 16 and 32, and the triggers it cannot feed unset or switched off."""
    off = {"fragmentation": {"enabled": False}, "oomEvents": {"enabled": False}}
    for name, spec in (
        ("vllm-16", {"runtime": "vllm"}),
        ("vllm-32", {"runtime": "vllm", "memoryPolicy": {"blockSize": 32}}),
        ("vllm-off", {"runtime": "vllm", "remediation": {"triggers": off}}),
    ):
        result = _apply(cluster, namespace, spec, name=name)
        assert result.returncode == 0, result.stderr


RUNNING: dict[str, Any] = {
    "model": {"source": "/models/m"},
    "resources": {"gpus": 1},
    "memoryPolicy": {"maxNumSeqs": 64},
    "tuning": {"bounds": {"maxNumSeqs": {"min": 32, "max": 128}}},
}
# Updates of a running server's tuning, each refused naming the field (a CEL rule's message,
# or the schema's bound).
BAD_UPDATES = [
    (
        {"tuning": {"bounds": {"maxNumSeqs": {"min": 128, "max": 256}}}},
        "spec.tuning.bounds.maxNumSeqs: Invalid value",
        BOUNDS_RULES[4]["message"],
    ),
    (
        {"memoryPolicy": {"maxNumSeqs": 256}},  # the value leaves the bounds it had
        "spec.tuning.bounds.maxNumSeqs: Invalid value",
        BOUNDS_RULES[4]["message"],
    ),
    (
        {"tuning": {"objective": "ThroughputUnderTTFT"}},
        "spec.tuning.ttftP99Seconds: Invalid value",
        TTFT_RULE["message"],
    ),
    (
        {"tuning": {"objective": "ThroughputUnderITL"}},
        "spec.tuning.itlP99Seconds: Invalid value",
        ITL_RULE["message"],
    ),
    (
        {"tuning": {"windowSeconds": -5}},
        "spec.tuning.windowSeconds: Invalid value",
        "should be greater than or equal to 60",
    ),
]


def _running_state(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """What a refused update must leave as it was: the stored server's spec and metadata (but
    the resourceVersion and managedFields that status writes move), the Deployment's
    resourceVersion and template, and the pods."""
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    server = get_server(cluster, namespace, "run")
    meta = server["metadata"]
    deployment = apps.read_namespaced_deployment("run", namespace)
    pods = core.list_namespaced_pod(namespace, label_selector=f"{SERVER_LABEL}=run").items
    return {
        "spec": server["spec"],
        "metadata": {k: meta.get(k) for k in ("generation", "labels", "annotations", "uid")},
        "deployment": (deployment.metadata.resource_version, deployment.spec.template.to_dict()),
        "pods": sorted(
            (p.metadata.name, p.metadata.uid, p.metadata.resource_version) for p in pods
        ),
    }


def _rollout_complete(cluster: Cluster, namespace: str) -> bool:
    """The Deployment's controller is done with it (Available, NewReplicaSetAvailable)."""
    deployment = client.AppsV1Api(cluster.api).read_namespaced_deployment("run", namespace)
    conditions = {c.type: c for c in deployment.status.conditions or []}
    return (
        deployment.status.observed_generation == deployment.metadata.generation
        and deployment.status.available_replicas == 1
        and conditions.get("Available") is not None
        and conditions["Available"].status == "True"
        and conditions.get("Progressing") is not None
        and conditions["Progressing"].reason == "NewReplicaSetAvailable"
    )


def test_bad_tuning_on_a_running_server_is_refused_and_disturbs_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(cluster, namespace, llmserver("run", RUNNING))
    wait_ready(cluster, namespace, "run", 1)
    wait_for(lambda: _rollout_complete(cluster, namespace), what="the rollout complete")
    before = _running_state(cluster, namespace)
    assert len(before["pods"]) == 1
    for update, field, message in BAD_UPDATES:
        body = llmserver("run", merge(RUNNING, update))
        result = cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False
        )
        assert result.returncode != 0, update
        assert field in result.stderr, (update, result.stderr)
        assert message in result.stderr, (update, result.stderr)
    # A resync after the refusals has seen the server as stored: nothing moved.
    num_resyncs = operator.log().count(RESYNC_DONE)
    wait_for(
        lambda: operator.log().count(RESYNC_DONE) > num_resyncs,
        timeout=RESYNC_SECONDS * 6,
        what="a resync after the refusals",
    )
    assert _running_state(cluster, namespace) == before
    assert "reconciled generation 2" not in operator.log()


def test_a_status_time_stamp_that_is_not_rfc_3339_is_refused_naming_the_field(
    cluster: Cluster, namespace: str, llmserver_crd: Path
) -> None:
    """Time stamps are typed (`format: date-time`): the API server refuses other text in
    status, whoever writes it, so the operator never reads one it cannot parse."""
    assert _apply(cluster, namespace, {}, name="stamped").returncode == 0
    canary = {"phase": "Analyzing", "templateHash": "a", "stableTemplateHash": "b"}

    def patch_status(started_at: str) -> Any:
        patch = {"status": {"canary": {**canary, "startedAt": started_at}}}
        return cluster.kubectl(
            "patch", "llmserver", "stamped", "-n", namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(patch), check=False,
        )  # fmt: skip

    refused = patch_status("yesterday")
    assert refused.returncode != 0
    assert "status.canary.startedAt" in refused.stderr and "date-time" in refused.stderr
    assert patch_status("2026-11-29T01:00:00Z").returncode == 0
