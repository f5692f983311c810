"""The operator on the test cluster as fixtures (`harness.operator_process`), and the LLMServer
helpers the integration tests share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, wait_for
from harness.operator_process import CRD_PATH, OperatorProcess
from harness.tools import CACHE, missing

# Fetched by hack/provision.sh from the Gateway API Inference Extension's Go module.
INFERENCE_POOL_CRDS = sorted(
    CACHE.glob("crds/gateway-api-inference-extension-*/inference.networking.k8s.io_*.yaml")
)
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"
GROUP, VERSION, PLURAL = "pagekeeper.dev", "v1alpha1", "llmservers"


@pytest.fixture(scope="session")
def llmserver_crd(cluster: Cluster) -> Path:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    cluster.wait_established("llmservers.pagekeeper.dev")
    return CRD_PATH


def _crd_exists(cluster: Cluster, name: str) -> bool:
    return cluster.kubectl("get", "crd", name, "--ignore-not-found", "-o", "name").stdout != ""


@pytest.fixture
def inference_pool_crd(cluster: Cluster) -> Iterator[Path]:
    """The InferencePool CRD, installed for one test and removed after it, so every other
    test runs on a cluster without it (the operator must then render no InferencePool)."""
    if not INFERENCE_POOL_CRDS:
        missing("the InferencePool CRD (gateway-api-inference-extension)")
    [path] = INFERENCE_POOL_CRDS
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.wait_established(INFERENCE_POOL_CRD)
    try:
        yield path
    finally:
        cluster.kubectl("delete", "-f", str(path), "--wait=true", "--timeout=120s")


@pytest.fixture
def no_inference_pool_crd(cluster: Cluster) -> None:
    """A cluster without the InferencePool CRD (another test's may still be going away)."""
    wait_for(
        lambda: not _crd_exists(cluster, INFERENCE_POOL_CRD),
        timeout=120,
        what=f"CRD {INFERENCE_POOL_CRD} absent",
    )


@pytest.fixture
def operator(
    cluster: Cluster, namespace: str, llmserver_crd: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    # Pods the operator renders must pass PodSecurity `restricted`.
    cluster.kubectl(
        "label",
        "namespace",
        namespace,
        "pod-security.kubernetes.io/enforce=restricted",
        "--overwrite",
    )
    process = OperatorProcess(cluster, namespace, tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def apply_server(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def get_server(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return obj


def get_or_none(read: Any, *args: Any) -> Any:
    try:
        return read(*args)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def wait_ready(
    cluster: Cluster, namespace: str, name: str, num_replicas: int, timeout: float = 120
) -> dict[str, Any]:
    """Until status says Ready with all replicas, for the current generation; the object."""

    def ready() -> dict[str, Any] | None:
        obj = get_server(cluster, namespace, name)
        status = obj.get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        if (
            status.get("observedGeneration") == obj["metadata"]["generation"]
            and conditions.get("Ready", {}).get("status") == "True"
            and conditions.get("Progressing", {}).get("status") == "False"
            and status.get("readyReplicas") == num_replicas
        ):
            return obj
        return None

    obj: dict[str, Any] = wait_for(ready, timeout=timeout, what=f"LLMServer {name} Ready")
    return obj


def wait_quiet(version_of: Callable[[], str], seconds: float = 3, timeout: float = 60) -> str:
    """Until a resourceVersion holds still for `seconds`; returns it."""
    deadline = time.monotonic() + timeout
    version = version_of()
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = version_of()
        if current != version:
            version, since = current, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return version
    raise AssertionError(f"object kept changing (last resourceVersion {version})")
