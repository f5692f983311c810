"""The engine Deployment: pods that survive slow model loads, drain on shutdown, and pass
PodSecurity `restricted`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.effective import memory_policy_hash
from pagekeeper_operator.policy.host_memory import memory_quantities, shm_size
from pagekeeper_operator.render.engine import (
    CACHE_DIR,
    TMP_DIR,
    engine_command,
    engine_env,
    stuck_timeout_flags,
)
from pagekeeper_operator.render.kv_events import kv_events_ports, publishes_kv_events
from pagekeeper_operator.render.meta import (
    CONTAINER_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    POLICY_HASH_ANNOTATION,
    common_labels,
    object_meta,
    selector_labels,
)
from pagekeeper_operator.render.vllm import (
    bundle_mount,
    bundle_volume,
    init_container,
    launcher_command,
    metrics_port,
)

GPU_RESOURCE = "nvidia.com/gpu"
RUN_AS_USER = 1000
SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# Loading a large checkpoint can take many minutes: the startup probe allows 30 of them.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180
# Sleep before SIGTERM so endpoints drop the pod before the engine stops taking requests.
PRE_STOP_SECONDS = 5
# Time past the engine's own drain deadline for it to exit and flush logs.
EXIT_MARGIN_SECONDS = 10
PROGRESS_DEADLINE_SECONDS = STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD + 600


def _probe(path: str, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _probes(runtime: Runtime) -> dict[str, Any]:
    # vLLM has no readiness endpoint of its own; /health answers once the model is loaded.
    ready_path = "/ready" if runtime == "pagekeeper" else "/health"
    return {
        "startupProbe": _probe(
            "/health", period=STARTUP_PERIOD_SECONDS, failures=STARTUP_FAILURE_THRESHOLD, timeout=5
        ),
        "readinessProbe": _probe(ready_path, period=5, failures=2, timeout=3),
        "livenessProbe": _probe("/health", period=10, failures=6, timeout=5),
    }


def _resources(server: LLMServer, policy: MemoryPolicy) -> dict[str, Any]:
    """The spec's requests and limits, with the memory the host plan sets where the spec
    leaves it (`host_memory`)."""
    spec = server.spec.resources
    requests = spec.requests.to_api()
    limits = spec.limits.to_api()
    planned = memory_quantities(server, policy)
    if "requests" in planned:
        requests["memory"] = planned["requests"]
    if "limits" in planned:
        limits["memory"] = planned["limits"]
    num_gpus = server.spec.num_gpus
    if num_gpus > 0:
        limits[GPU_RESOURCE] = str(num_gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _container(server: LLMServer, policy: MemoryPolicy, image: str) -> dict[str, Any]:
    spec = server.spec
    is_vllm = spec.runtime == "vllm"
    mounts = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *([bundle_mount()] if is_vllm else []),
        *(mount.to_api() for mount in spec.pod_template.volume_mounts),
    ]
    command = engine_command(server, policy, image)
    has_kv_events = publishes_kv_events(server, policy, image)
    ports = [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if is_vllm:
        command = launcher_command(command, stuck_timeout_flags(server))
        ports.append(metrics_port())
    if has_kv_events:
        ports += kv_events_ports(spec.gateway.kv_events)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": command,
        "env": engine_env(server, policy, has_kv_events=has_kv_events),
        "ports": ports,
        "resources": _resources(server, policy),
        "volumeMounts": mounts,
        **_probes(spec.runtime),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(SECURITY_CONTEXT),
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _pod_spec(
    server: LLMServer, policy: MemoryPolicy, image: str, engine_image: str
) -> dict[str, Any]:
    spec = server.spec
    overrides = spec.pod_template
    node_selector = dict(overrides.node_selector)
    if spec.resources.gpu_type is not None:
        node_selector[GPU_PRODUCT_LABEL] = spec.resources.gpu_type
    tolerations = list(overrides.tolerations)
    if spec.num_gpus > 0:
        # GPU nodes are commonly tainted so that only GPU workloads land on them.
        tolerations.insert(0, {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "containers": [_container(server, policy, image)],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(server)},
            },
            *([bundle_volume()] if spec.runtime == "vllm" else []),
            *overrides.volumes,
        ],
        "terminationGracePeriodSeconds": (
            PRE_STOP_SECONDS + spec.shutdown_grace_period_seconds + EXIT_MARGIN_SECONDS
        ),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The engine never talks to the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "tolerations": tolerations,
    }
    if spec.runtime == "vllm":
        pod["initContainers"] = [init_container(engine_image, dict(SECURITY_CONTEXT))]
    if node_selector:
        pod["nodeSelector"] = node_selector
    if overrides.affinity is not None:
        pod["affinity"] = overrides.affinity
    if overrides.priority_class_name is not None:
        pod["priorityClassName"] = overrides.priority_class_name
    if overrides.service_account_name is not None:
        pod["serviceAccountName"] = overrides.service_account_name
    if overrides.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in overrides.image_pull_secrets]
    if not tolerations:
        del pod["tolerations"]
    return pod


def render_deployment(
    server: LLMServer, default_images: Mapping[str, str], policy: MemoryPolicy | None = None
) -> dict[str, Any]:
    """The Deployment running the engine pods with `policy`, the effective memory policy the
    reconcile composed (`EffectivePolicy.rendered`: with a trial's change while one runs); tools
    and tests that pass none get the same, `effective.compose(server).rendered`.

    The pod template carries `pagekeeper.dev/policy-hash` of the effective memory policy: a
    policy change alters the template and rolls the pods; a replicas change does not. Under
    spec.autoscaling `replicas` is left out, so the server-side apply never owns it.
    """
    spec = server.spec
    if policy is None:
        policy = effective.compose(server).rendered
    image = spec.image or default_images[spec.runtime]
    pod_labels = {**spec.pod_template.labels, **common_labels(server)}
    pod_annotations = {
        **spec.pod_template.annotations,
        POLICY_HASH_ANNOTATION: memory_policy_hash(policy),
        "kubectl.kubernetes.io/default-container": CONTAINER_NAME,
    }
    deployment_spec: dict[str, Any] = {}
    if not spec.is_autoscaled:
        # Under spec.autoscaling the field is the autoscaler's: rendering it would fight it.
        deployment_spec["replicas"] = spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(server),
        "spec": {
            **deployment_spec,
            "selector": {"matchLabels": selector_labels(server)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": pod_labels, "annotations": pod_annotations},
                "spec": _pod_spec(server, policy, image, default_images["pagekeeper"]),
            },
        },
    }
