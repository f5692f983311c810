"""Rendered manifests, asserted exactly."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.policy.effective import allocator_conf, memory_policy_hash
from pagekeeper_operator.render import (
    ClusterFeatures,
    render_all,
    render_deployment,
    render_pod_disruption_budget,
    render_service,
    render_service_monitor,
    unwanted_objects,
)
from tests.operator.servers import DEFAULT_IMAGES, make_server

LABELS = {
    "app.kubernetes.io/name": "pagekeeper-engine",
    "pagekeeper.dev/llmserver": "qwen",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/managed-by": "pagekeeper-operator",
    "app.kubernetes.io/part-of": "pagekeeper",
}
# A server without spec.autoscaling looks for a HorizontalPodAutoscaler it may once have made.
HPA_KEY = ("autoscaling/v2", "HorizontalPodAutoscaler", "qwen")
SELECTOR = {"app.kubernetes.io/name": "pagekeeper-engine", "pagekeeper.dev/llmserver": "qwen"}
OWNER = {
    "apiVersion": "pagekeeper.dev/v1alpha1",
    "kind": "LLMServer",
    "name": "qwen",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}
META = {"name": "qwen", "namespace": "ml", "labels": LABELS, "ownerReferences": [OWNER]}
SPEC = {
    "replicas": 2,
    "parallelism": {"tensor": 2},
    "resources": {
        "gpus": 2,
        "gpuType": "NVIDIA-H100-80GB-HBM3",
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "96Gi"},
    },
    "memoryPolicy": {
        "gpuMemoryUtilization": 0.85,
        "maxModelLen": 8192,
        "swapSpaceGiB": 4,
        "allocator": {"garbageCollectionThreshold": 0.8},
    },
    "shutdownGracePeriodSeconds": 60,
    "podTemplate": {
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "HOME", "value": "/home/engine"},
        ],
        "priorityClassName": "llm",
        "nodeSelector": {"pool": "gpu"},
    },
}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_deployment_pod_spec_exactly() -> None:
    server = make_server(SPEC)
    deployment = render_deployment(server, DEFAULT_IMAGES)
    assert deployment["metadata"] == META
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"] == {"matchLabels": SELECTOR}
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert spec["progressDeadlineSeconds"] == 2400
    template = spec["template"]
    assert template["metadata"] == {
        "labels": LABELS,
        "annotations": {
            "pagekeeper.dev/policy-hash": memory_policy_hash(server.spec.memory_policy),
            "kubectl.kubernetes.io/default-container": "engine",
        },
    }
    pod = template["spec"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 60 + 10
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["automountServiceAccountToken"] is False
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["priorityClassName"] == "llm"
    assert pod["volumes"] == [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ]
    container = _container(deployment)
    assert container["image"] == "registry.test/pagekeeper-engine:1"
    assert container["command"] == [
        "pagekeeper-engine",
        "serve",
        "/models/qwen3-0.6b",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--dtype",
        "auto",
        "--load-format",
        "auto",
        "--device",
        "cuda",
        "--tensor-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.85",
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "256",
        "--max-model-len",
        "8192",
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        "--swap-space",
        "4",
        "--prefix-cache-max-fraction",
        "0.5",
        "--fragmentation-buffer",
        "auto",
        "--shutdown-timeout",
        "60",
    ]
    conf = "expandable_segments:True,garbage_collection_threshold:0.8"
    assert container["env"] == [
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": conf},
        {"name": "PYTORCH_ALLOC_CONF", "value": conf},
        {"name": "HOME", "value": "/home/engine"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/inductor"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "96Gi", "nvidia.com/gpu": "2"},
    }
    assert container["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    assert container["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 180,
        "timeoutSeconds": 5,
    }
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_startup_probe_allows_thirty_minutes_and_grace_covers_the_drain() -> None:
    container = _container(render_deployment(make_server(), DEFAULT_IMAGES))
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    pod = render_deployment(make_server(), DEFAULT_IMAGES)["spec"]["template"]["spec"]
    timeout = float(container["command"][container["command"].index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] >= 5 + timeout


def test_vllm_runtime_gets_vllm_command_without_pagekeeper_only_flags() -> None:
    server = make_server(
        {
            "runtime": "vllm",
            "model": {"servedModelName": "qwen"},
            "memoryPolicy": {"enablePrefixCaching": False},
        }
    )
    container = _container(render_deployment(server, DEFAULT_IMAGES))
    assert container["image"] == "registry.test/vllm:1"
    assert container["command"] == [
        "python3",
        "-m",
        "pagekeeper_vllm.launch",
        "--metrics-port",
        "8001",
        "--",
        "vllm",
        "serve",
        "/models/qwen3-0.6b",
        "--served-model-name",
        "qwen",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--dtype",
        "auto",
        "--load-format",
        "auto",
        "--gpu-memory-utilization",
        "0.9",
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "256",
        "--enable-chunked-prefill",
        "--no-enable-prefix-caching",
    ]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_vllm_pod_carries_the_plugin_from_the_engine_image() -> None:
    """An init container copies the bundle; the stock vLLM image runs it read-only."""
    server = make_server(
        {"runtime": "vllm", "podTemplate": {"env": [{"name": "PYTHONPATH", "value": "/extra"}]}}
    )
    pod = render_deployment(server, DEFAULT_IMAGES)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["initContainers"] == [
        {
            "name": "pagekeeper-vllm-plugin",
            "image": "registry.test/pagekeeper-engine:1",
            "command": ["python3", "-m", "pagekeeper_vllm.bundle", "/opt/pagekeeper"],
            "volumeMounts": [{"name": "pagekeeper-vllm", "mountPath": "/opt/pagekeeper"}],
            "resources": {
                "requests": {"cpu": "50m", "memory": "64Mi"},
                "limits": {"cpu": "500m", "memory": "256Mi"},
            },
            "securityContext": container["securityContext"],
        }
    ]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "pagekeeper-vllm", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    assert {
        "name": "pagekeeper-vllm",
        "mountPath": "/opt/pagekeeper",
        "readOnly": True,
    } in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PYTHONPATH"] == {"name": "PYTHONPATH", "value": "/opt/pagekeeper:/extra"}
    assert [e["name"] for e in container["env"]].count("PYTHONPATH") == 1
    assert container["ports"][1] == {"name": "pk-metrics", "containerPort": 8001, "protocol": "TCP"}
    service_ports = render_service(server)["spec"]["ports"]
    assert [p["name"] for p in service_ports] == ["http", "pk-metrics"]
    endpoints = render_service_monitor(server)["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["http", "pk-metrics"]
    assert endpoints[0]["relabelings"] == endpoints[1]["relabelings"]
    # The paged engine gets none of it.
    plain = render_deployment(make_server({}), DEFAULT_IMAGES)["spec"]["template"]["spec"]
    assert "initContainers" not in plain
    assert [p["name"] for p in plain["containers"][0]["ports"]] == ["http"]
    assert "PYTHONPATH" not in {e["name"] for e in plain["containers"][0]["env"]}
    assert [e["port"] for e in render_service_monitor(make_server({}))["spec"]["endpoints"]] == [
        "http"
    ]


def test_cpu_only_server_has_no_gpu_limit_toleration_or_selector() -> None:
    server = make_server(
        {"resources": {"gpus": 0}, "image": "my/engine:2", "imagePullPolicy": "IfNotPresent"}
    )
    deployment = render_deployment(server, DEFAULT_IMAGES)
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert container["resources"] == {}
    assert container["command"][container["command"].index("--device") + 1] == "cpu"
    assert (container["image"], container["imagePullPolicy"]) == ("my/engine:2", "IfNotPresent")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"


def test_a_tensor_parallel_server_is_one_pod_of_that_many_gpus() -> None:
    deployment = render_deployment(make_server({"parallelism": {"tensor": 4}}), DEFAULT_IMAGES)
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    command = container["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    sized = make_server({"parallelism": {"tensor": 8}, "resources": {"sharedMemory": "16Gi"}})
    pod = render_deployment(sized, DEFAULT_IMAGES)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"


def test_surge_rollout_and_pod_overrides() -> None:
    server = make_server(
        {
            "rollout": {"maxSurge": 1, "maxUnavailable": 0},
            "podTemplate": {
                "labels": {"team": "search", "pagekeeper.dev/llmserver": "spoofed"},
                "annotations": {"prometheus.io/scrape": "false"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
                "affinity": {
                    "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
                },
                "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                "imagePullSecrets": ["regcred"],
                "serviceAccountName": "engine",
            },
        }
    )
    deployment = render_deployment(server, DEFAULT_IMAGES)
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"] == {"team": "search", **LABELS}
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "false"
    pod = template["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "llm"},
    ]
    assert pod["affinity"] == {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    assert pod["volumes"][-1] == {
        "name": "models",
        "persistentVolumeClaim": {"claimName": "models"},
    }
    assert _container(deployment)["volumeMounts"][-1] == {
        "name": "models",
        "mountPath": "/models",
        "readOnly": True,
    }
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "engine"


def test_policy_change_changes_the_template_and_replicas_change_does_not() -> None:
    base = render_deployment(make_server(SPEC), DEFAULT_IMAGES)
    scaled = render_deployment(make_server({**SPEC, "replicas": 5}), DEFAULT_IMAGES)
    assert scaled["spec"]["template"] == base["spec"]["template"]
    assert scaled["spec"]["replicas"] == 5
    tighter = make_server(
        {**SPEC, "memoryPolicy": {**SPEC["memoryPolicy"], "gpuMemoryUtilization": 0.8}}
    )
    changed = render_deployment(tighter, DEFAULT_IMAGES)
    old_hash = base["spec"]["template"]["metadata"]["annotations"]["pagekeeper.dev/policy-hash"]
    new_hash = changed["spec"]["template"]["metadata"]["annotations"]["pagekeeper.dev/policy-hash"]
    assert old_hash != new_hash and len(new_hash) == 16


def test_effective_policy_from_status_applies_only_to_the_spec_it_came_from() -> None:
    server = make_server(SPEC)
    stepped = server.spec.memory_policy.model_copy(update={"gpu_memory_utilization": 0.8})
    status = {
        "effectiveMemoryPolicy": stepped.to_api(),
        "specMemoryPolicyHash": memory_policy_hash(server.spec.memory_policy),
    }
    adapted = make_server(SPEC, status=status)
    command = _container(render_deployment(adapted, DEFAULT_IMAGES))["command"]
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.8"
    stale = make_server(SPEC, status={**status, "specMemoryPolicyHash": "0" * 16})
    command = _container(render_deployment(stale, DEFAULT_IMAGES))["command"]
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.85"


def test_allocator_conf_text() -> None:
    allocator = make_server(
        {
            "memoryPolicy": {
                "allocator": {
                    "expandableSegments": False,
                    "garbageCollectionThreshold": 0.6,
                    "maxSplitSizeMb": 512,
                }
            }
        }
    ).spec.memory_policy.allocator
    assert allocator_conf(allocator) == (
        "expandable_segments:False,garbage_collection_threshold:0.6,max_split_size_mb:512"
    )


def test_service_pdb_and_service_monitor_exactly() -> None:
    server = make_server(
        {
            "service": {
                "type": "LoadBalancer",
                "port": 80,
                "annotations": {"lb.example/internal": "true"},
            },
            "remediation": {"maxUnavailable": 2},
        }
    )
    assert render_service(server) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**META, "annotations": {"lb.example/internal": "true"}},
        "spec": {
            "type": "LoadBalancer",
            "selector": SELECTOR,
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    assert render_pod_disruption_budget(server) == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": META,
        "spec": {
            "maxUnavailable": 2,
            "selector": {"matchLabels": SELECTOR},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    assert render_service_monitor(server) == {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": META,
        "spec": {
            "selector": {"matchLabels": SELECTOR},
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": "15s",
                    "relabelings": [
                        {
                            "sourceLabels": ["__meta_kubernetes_namespace"],
                            "targetLabel": "namespace",
                            "action": "replace",
                        },
                        {
                            "sourceLabels": ["__meta_kubernetes_pod_name"],
                            "targetLabel": "pod",
                            "action": "replace",
                        },
                        {
                            "sourceLabels": [
                                "__meta_kubernetes_pod_label_pagekeeper_dev_llmserver"
                            ],
                            "targetLabel": "llmserver",
                            "action": "replace",
                        },
                    ],
                }
            ],
        },
    }


def test_user_brings_their_own_disruption_budget() -> None:
    managed = make_server()
    assert managed.spec.disruption_budget.managed is True
    assert unwanted_objects(managed, ClusterFeatures()) == [HPA_KEY]
    own = make_server({"disruptionBudget": {"managed": False}})
    kinds = [o["kind"] for o in render_all(own, DEFAULT_IMAGES, ClusterFeatures(True, True))]
    assert kinds == ["Service", "Deployment", "ServiceMonitor", "PrometheusRule"]
    assert unwanted_objects(own, ClusterFeatures()) == [
        ("policy/v1", "PodDisruptionBudget", "qwen"),
        HPA_KEY,
    ]


def test_render_all_follows_cluster_features() -> None:
    server = make_server()
    kinds = [o["kind"] for o in render_all(server, DEFAULT_IMAGES, ClusterFeatures())]
    assert kinds == ["Service", "PodDisruptionBudget", "Deployment"]
    full = render_all(server, DEFAULT_IMAGES, ClusterFeatures(True, True))
    assert [o["kind"] for o in full] == [*kinds, "ServiceMonitor", "PrometheusRule"]
    rule = full[-1]
    assert rule["metadata"]["namespace"] == "ml"
    assert rule["metadata"]["ownerReferences"] == [OWNER]
    assert rule["spec"]["groups"][0]["rules"]


POOL_SPEC = {"gateway": {"inferencePool": {"endpointPickerRef": {"name": "qwen-epp"}}}}
ALL_FEATURES = ClusterFeatures(True, True, True)


def test_inference_pool_exactly() -> None:
    server = make_server(POOL_SPEC)
    pool = render_all(server, DEFAULT_IMAGES, ALL_FEATURES)[-1]
    assert pool == {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "qwen",
            "namespace": "ml",
            "labels": LABELS,
            "ownerReferences": [OWNER],
        },
        "spec": {
            "selector": {"matchLabels": SELECTOR},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": "qwen-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }
    # The pool selects exactly the Deployment's pods, on the port their container serves.
    deployment = render_deployment(server, DEFAULT_IMAGES)
    assert deployment["spec"]["selector"]["matchLabels"] == SELECTOR
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == 8000
    picker = {"name": "epp", "port": 9100, "failureMode": "FailOpen"}
    other = make_server({"gateway": {"inferencePool": {"endpointPickerRef": picker}}})
    ref = render_all(other, DEFAULT_IMAGES, ALL_FEATURES)[-1]["spec"]["endpointPickerRef"]
    assert ref == {
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9100},
        "failureMode": "FailOpen",
    }


def test_inference_pool_needs_the_spec_and_the_crd() -> None:
    kinds = [o["kind"] for o in render_all(make_server(), DEFAULT_IMAGES, ALL_FEATURES)]
    assert "InferencePool" not in kinds  # off by default
    asked = make_server(POOL_SPEC)
    without_crd = render_all(asked, DEFAULT_IMAGES, ClusterFeatures(True, True, False))
    assert "InferencePool" not in [o["kind"] for o in without_crd]
    # Once unset, the one the operator made is deleted; without the CRD nothing is looked for.
    pool_key = ("inference.networking.k8s.io/v1", "InferencePool", "qwen")
    assert unwanted_objects(make_server(), ALL_FEATURES) == [pool_key, HPA_KEY]
    assert unwanted_objects(make_server(), ClusterFeatures()) == [HPA_KEY]
    assert unwanted_objects(asked, ALL_FEATURES) == [HPA_KEY]
