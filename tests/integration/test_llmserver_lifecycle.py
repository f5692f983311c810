"""An LLMServer's life on the real control plane with the operator running."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import OperatorProcess
from pagekeeper_operator.alerts.render import ALERT_NAMES
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.render import render_deployment
from pagekeeper_operator.render.network import render_service_monitor
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    apply_server,
    get_or_none,
    get_server,
    wait_ready,
)

# Fixtures shared by the LLMServer integration tests.
llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "resources": {
        "gpus": 1,
        "gpuType": "NVIDIA-H100-80GB-HBM3",
        "requests": {"cpu": "2", "memory": "8Gi"},
    },
    "memoryPolicy": {
        "gpuMemoryUtilization": 0.9,
        "maxModelLen": 4096,
        "allocator": {"garbageCollectionThreshold": 0.8},
    },
}
IMAGES = {
    "pagekeeper": "ghcr.io/pagekeeper-dev/pagekeeper-engine:0.1.0",
    "vllm": "docker.io/vllm/vllm-openai:v0.11.0",
}


def _replica_sets(cluster: Cluster, namespace: str, name: str) -> dict[str, int]:
    """ReplicaSet name -> spec.replicas, for the server's pods."""
    items = (
        client.AppsV1Api(cluster.api)
        .list_namespaced_replica_set(namespace, label_selector=f"pagekeeper.dev/llmserver={name}")
        .items
    )
    return {rs.metadata.name: rs.spec.replicas for rs in items}


def test_create_update_scale_delete(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    apply_server(cluster, namespace, llmserver("qwen", SPEC))

    # create -> the Deployment runs the engine with the policy's args and env, pods Ready
    obj = wait_ready(cluster, namespace, "qwen", 1)
    deployment = apps.read_namespaced_deployment("qwen", namespace)
    container = deployment.spec.template.spec.containers[0]
    expected = render_deployment(LLMServer.model_validate(obj), IMAGES)
    expected_container = expected["spec"]["template"]["spec"]["containers"][0]
    assert container.command == expected_container["command"]
    assert "--gpu-memory-utilization" in container.command
    assert container.command[container.command.index("--max-model-len") + 1] == "4096"
    env = {e.name: e.value for e in container.env}
    assert (
        env["PYTORCH_CUDA_ALLOC_CONF"]
        == "expandable_segments:True,garbage_collection_threshold:0.8"
    )
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"]
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    assert deployment.metadata.owner_references[0].uid == obj["metadata"]["uid"]
    pods = core.list_namespaced_pod(namespace, label_selector="pagekeeper.dev/llmserver=qwen").items
    assert [p.spec.node_name for p in pods] == ["kwok-gpu-0"]  # the H100 node
    assert all({c.type: c.status for c in p.status.conditions}["Ready"] == "True" for p in pods)
    status = obj["status"]
    assert status["effectiveMemoryPolicy"]["gpuMemoryUtilization"] == 0.9
    assert {c["type"] for c in status["conditions"]} == {
        "Ready",
        "Progressing",
        "Degraded",
        "Reconciling",
        "Stalled",
        "MemoryHealthy",
        "PolicyFits",
    }
    # Qwen3-0.6B is in the plan's catalogue; kwok-gpu-0 is labelled as an H100 80GB.
    assert status["memoryPlan"]["state"] == "Fits"
    assert status["memoryPlan"]["gpu"] == "NVIDIA-H100-80GB-HBM3"
    printed = cluster.kubectl("get", "llms", "qwen", "-n", namespace).stdout.split("\n")
    assert printed[0].split() == [
        "NAME",
        "READY",
        "CURRENT",
        "DESIRED",
        "RECONCILING",
        "STALLED",
        "RUNTIME",
        "GPU-UTIL",
        "FITS",
        "LAST-SCALE",
        "RECOMMENDATION",
        "LAST-REMEDIATION",
        "OLDEST-POD",
        "AGE",
    ]
    assert printed[1].split()[:9] == [
        "qwen", "1", "1", "1", "False", "False", "pagekeeper", "0.9", "Fits"
    ]  # fmt: skip
    first_sets = _replica_sets(cluster, namespace, "qwen")
    assert len(first_sets) == 1

    # a policy change rolls the pods: a new ReplicaSet
    apply_server(
        cluster,
        namespace,
        llmserver(
            "qwen", {**SPEC, "memoryPolicy": {**SPEC["memoryPolicy"], "gpuMemoryUtilization": 0.8}}
        ),
    )
    obj = wait_ready(cluster, namespace, "qwen", 1)
    assert obj["status"]["effectiveMemoryPolicy"]["gpuMemoryUtilization"] == 0.8
    rolled_sets = _replica_sets(cluster, namespace, "qwen")
    assert len(rolled_sets) == 2 and set(first_sets) < set(rolled_sets)
    new_set = (set(rolled_sets) - set(first_sets)).pop()
    assert rolled_sets[new_set] == 1 and all(rolled_sets[n] == 0 for n in first_sets)

    # a replicas change does not: the same ReplicaSets, the current one scaled
    apply_server(
        cluster,
        namespace,
        llmserver(
            "qwen",
            {
                **SPEC,
                "replicas": 2,
                "memoryPolicy": {**SPEC["memoryPolicy"], "gpuMemoryUtilization": 0.8},
            },
        ),
    )
    wait_ready(cluster, namespace, "qwen", 2)
    scaled_sets = _replica_sets(cluster, namespace, "qwen")
    assert set(scaled_sets) == set(rolled_sets) and scaled_sets[new_set] == 2

    # delete -> the garbage collector removes every child through the owner references
    cluster.kubectl("delete", "llmserver", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")
    custom = client.CustomObjectsApi(cluster.api)
    policy = client.PolicyV1Api(cluster.api)

    def children() -> list[Any]:
        return [
            get_or_none(apps.read_namespaced_deployment, "qwen", namespace),
            get_or_none(core.read_namespaced_service, "qwen", namespace),
            get_or_none(policy.read_namespaced_pod_disruption_budget, "qwen", namespace),
            get_or_none(
                custom.get_namespaced_custom_object,
                "monitoring.coreos.com",
                "v1",
                namespace,
                "servicemonitors",
                "qwen",
            ),
            get_or_none(
                custom.get_namespaced_custom_object,
                "monitoring.coreos.com",
                "v1",
                namespace,
                "prometheusrules",
                "qwen-memory-alerts",
            ),
        ]

    wait_for(lambda: children() == [None] * 5, timeout=90, what="children garbage-collected")
    wait_for(
        lambda: (
            not core.list_namespaced_pod(
                namespace, label_selector="pagekeeper.dev/llmserver=qwen"
            ).items
        ),
        timeout=90,
        what="pods gone",
    )


def test_service_monitor_and_rules_are_created_and_owned(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_server(
        cluster,
        namespace,
        llmserver("small", {"model": {"source": "/m"}, "resources": {"gpus": 1}}),
    )
    obj = wait_ready(cluster, namespace, "small", 1)
    custom = client.CustomObjectsApi(cluster.api)
    monitor = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", namespace, "servicemonitors", "small"
    )
    rule = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", namespace, "prometheusrules", "small-memory-alerts"
    )
    for child in (monitor, rule):
        assert child["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    rendered = render_service_monitor(LLMServer.model_validate(obj))
    assert monitor["spec"]["endpoints"] == rendered["spec"]["endpoints"]
    relabelled = {r["targetLabel"] for r in monitor["spec"]["endpoints"][0]["relabelings"]}
    assert {"namespace", "pod", "llmserver"} <= relabelled
    service = client.CoreV1Api(cluster.api).read_namespaced_service("small", namespace)
    assert service.spec.ports[0].name == "http" and service.spec.ports[0].target_port == "http"
    pdb = client.PolicyV1Api(cluster.api).read_namespaced_pod_disruption_budget("small", namespace)
    assert pdb.spec.max_unavailable == 1
    assert get_server(cluster, namespace, "small")["status"]["selector"] == (
        "app.kubernetes.io/name=pagekeeper-engine,pagekeeper.dev/llmserver=small"
    )


def test_vllm_server_gets_every_alert_and_says_what_its_vllm_ignores(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {
        "model": {"source": "Qwen/Qwen3-0.6B"},
        "runtime": "vllm",
        "resources": {"gpus": 1},
        "memoryPolicy": {"enableChunkedPrefill": False, "maxModelLen": 4096},
    }
    apply_server(cluster, namespace, llmserver("upstream", spec))
    obj = wait_ready(cluster, namespace, "upstream", 1)
    rule = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", namespace, "prometheusrules", "upstream-memory-alerts"
    )
    [group] = rule["spec"]["groups"]
    # Every alert but the host tier's, whose series vLLM does not export.
    tier_alert = "PagekeeperKVOffloadOverCapacity"
    assert [r["alert"] for r in group["rules"]] == [a for a in ALERT_NAMES if a != tier_alert]
    assert [t["name"] for t in obj["status"]["triggers"] if not t["active"]] == [
        "kvOffloadOverCapacity"
    ]
    [pod] = (
        client.CoreV1Api(cluster.api)
        .list_namespaced_pod(namespace, label_selector="pagekeeper.dev/llmserver=upstream")
        .items
    )
    assert [c.name for c in pod.spec.init_containers] == ["pagekeeper-vllm-plugin"]
    # The operator's default vLLM image is 0.11.0, which turns chunked prefill back on.
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["PolicyHonored"]["status"] == "False"
    assert conditions["PolicyHonored"]["reason"] == "IgnoredByRuntime"
    assert conditions["PolicyHonored"]["message"].startswith(
        "vLLM 0.11.0 ignores spec.memoryPolicy.enableChunkedPrefill: false"
    )
    assert conditions["PluginLoaded"]["status"] == "True"

    # VLLM_PLUGINS without pagekeeper: the allocator alerts go, and the status says why.
    spec["podTemplate"] = {"env": [{"name": "VLLM_PLUGINS", "value": "lora_filesystem_resolver"}]}
    apply_server(cluster, namespace, llmserver("upstream", spec))

    def unplugged() -> dict[str, Any] | None:
        status = get_server(cluster, namespace, "upstream").get("status", {})
        loaded = {c["type"]: c for c in status.get("conditions", [])}.get("PluginLoaded", {})
        return status if loaded.get("status") == "False" else None

    status = wait_for(unplugged, what="PluginLoaded False")
    loaded = {c["type"]: c for c in status["conditions"]}["PluginLoaded"]
    assert loaded["reason"] == "ExcludedByVLLMPlugins"
    triggers = {t["name"]: t for t in status["triggers"]}
    assert triggers["fragmentation"]["reason"] == "SeriesNotExported"
    assert triggers["oomEvents"]["active"] is False

    def four_rules() -> list[dict[str, Any]] | None:
        rule = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "prometheusrules", "upstream-memory-alerts"
        )
        rules: list[dict[str, Any]] = rule["spec"]["groups"][0]["rules"]
        return rules if len(rules) == 4 else None

    rules = wait_for(four_rules, what="the allocator alerts removed")
    # The host-memory alert stays: it reads the cluster's series, not the plugin's.
    assert rules[-1]["alert"] == "PagekeeperHostMemoryNearLimit"
    assert "pagekeeper_" not in " ".join(r["expr"] for r in rules)


def test_a_tensor_parallel_server_becomes_one_pod_of_four_gpus(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    spec = {"model": {"source": "/models/llama-3.1-70b"}, "parallelism": {"tensor": 4}}
    apply_server(cluster, namespace, llmserver("big", spec))
    wait_ready(cluster, namespace, "big", 1)
    [pod] = (
        client.CoreV1Api(cluster.api)
        .list_namespaced_pod(namespace, label_selector="pagekeeper.dev/llmserver=big")
        .items
    )
    [container] = pod.spec.containers
    assert container.resources.limits == {"nvidia.com/gpu": "4"}
    command = container.command
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    [shm] = [v for v in pod.spec.volumes if v.name == "dshm"]
    assert (shm.empty_dir.medium, shm.empty_dir.size_limit) == ("Memory", "4Gi")
    assert any(m.mount_path == "/dev/shm" for m in container.volume_mounts)
    # KWOK's GPU nodes advertise 8 GPUs each: the scheduler placed the pod whole on one.
    assert pod.spec.node_name
