"""The operator image against the local control plane, run as the chart's Deployment runs it.

The chart is installed for one namespace; its operator container is run with podman from the
installed Deployment (the image's entrypoint with the chart's args, env, user, read-only root
and /tmp emptyDir, the webhook token Secret) and authenticates with its ServiceAccount's token
mounted read-only where a kubelet puts it. An LLMServer applied becomes its Deployment, Service
and PodDisruptionBudget and turns Ready; SIGTERM stops the operator with exit code 0.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.processes import free_ports
from harness.tools import REPO, tool
from tests.images.pod import PodHost, ServiceAccountToken, run_args
from tests.images.podman import Container, run_detached
from tests.integration import operator_fixture
from tests.integration.operator_fixture import wait_ready

pytestmark = pytest.mark.timeout(3600)  # a cold `images` fixture builds the bases
llmserver_crd = operator_fixture.llmserver_crd
CHART = REPO / "charts" / "pagekeeper"


def helm(cluster: Cluster, *args: str) -> str:
    result = subprocess.run(
        [tool("helm"), "--kubeconfig", cluster.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
    return result.stdout


def get_json(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout
    obj: dict[str, Any] = json.loads(out)
    return obj


def secret_dir(cluster: Cluster, namespace: str, volume: dict[str, Any], path: Path) -> Path:
    """A Secret volume's files, as a kubelet writes them (mode 0644)."""
    secret = get_json(cluster, namespace, "secret", volume["secret"]["secretName"])
    items = volume["secret"].get("items") or [{"key": k, "path": k} for k in secret["data"]]
    path.mkdir(mode=0o755)
    for item in items:
        file = path / item["path"]
        file.write_bytes(base64.b64decode(secret["data"][item["key"]]))
        file.chmod(0o644)
    return path


def service_account_token(
    cluster: Cluster, namespace: str, name: str, path: Path
) -> ServiceAccountToken:
    """The projected token, CA and namespace for ServiceAccount `name`, and the API server."""
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = kubeconfig["clusters"][0]["cluster"]
    path.mkdir(mode=0o755)
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout
    files = {
        "token": token.strip(),
        "ca.crt": Path(server["certificate-authority"]).read_text(),
        "namespace": namespace,
    }
    for file_name, text in files.items():
        (path / file_name).write_text(text)
        (path / file_name).chmod(0o644)
    address = urlsplit(server["server"])
    assert address.hostname is not None and address.port is not None, address
    return ServiceAccountToken(path, address.hostname, address.port)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@pytest.fixture
def release(cluster: Cluster, namespace: str, llmserver_crd: Path) -> Iterator[dict[str, Any]]:
    """The chart installed for `namespace`: its operator Deployment and the ports it uses."""
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )  # fmt: skip
    name = f"r{uuid.uuid4().hex[:6]}"
    health_port, webhook_port = free_ports(2)
    helm(
        cluster, "install", name, str(CHART), "-n", namespace,
        "--set", f"watchNamespaces={{{namespace}}}", "--set", "operator.resyncSeconds=5",
        "--set", f"operator.healthPort={health_port}", "--set", f"webhook.port={webhook_port}",
        "--set", "operator.logFormat=plain",
    )  # fmt: skip
    try:
        deployment = get_json(cluster, namespace, "deployment", f"{name}-pagekeeper-operator")
        yield {"deployment": deployment, "health_port": health_port}
    finally:
        helm(cluster, "uninstall", name, "-n", namespace)


def operator_run_args(
    cluster: Cluster,
    namespace: str,
    pod: dict[str, Any],
    image: str,
    tmp_path: Path,
    *,
    read_only_root: bool,
) -> list[str]:
    """What the node gives this pod (Secrets, token) under a fresh directory, and the args."""
    pod_name = f"operator-{uuid.uuid4().hex[:6]}"
    node_dir = tmp_path / pod_name
    node_dir.mkdir()
    secrets = {
        volume["name"]: secret_dir(cluster, namespace, volume, node_dir / volume["name"])
        for volume in pod["volumes"]
        if "secret" in volume
    }
    token = service_account_token(
        cluster, namespace, pod["serviceAccountName"], node_dir / "serviceaccount"
    )
    host = PodHost(pod_name, namespace, secrets, token)
    return run_args(pod, "operator", image, host, read_only_root=read_only_root)


@pytest.mark.parametrize("root_fs", ["read-only", "writable"])
def test_operator_image_reconciles_as_the_charts_deployment(
    cluster: Cluster,
    namespace: str,
    images: dict[str, str],
    release: dict[str, Any],
    tmp_path: Path,
    root_fs: str,
) -> None:
    pod = release["deployment"]["spec"]["template"]["spec"]
    args = operator_run_args(
        cluster, namespace, pod, images["operator"], tmp_path, read_only_root=root_fs == "read-only"
    )
    container = run_detached(f"pk-operator-{uuid.uuid4().hex[:6]}", args)
    try:
        _exercise(cluster, namespace, container, pod, release["health_port"])
        if root_fs == "read-only":
            assert "Read-only file system" not in container.logs()
        else:
            assert container.changes() == _noop_changes(cluster, namespace, pod, images, tmp_path)
    finally:
        container.remove()


def _exercise(
    cluster: Cluster, namespace: str, container: Container, pod: dict[str, Any], health_port: int
) -> None:
    def alive(check: Any) -> Any:
        assert container.is_running(), f"operator exited:\n{container.logs()[-4000:]}"
        return check()

    health = f"http://127.0.0.1:{health_port}/healthz"
    wait_for(lambda: alive(lambda: http_status(health) == 200), timeout=60, what="liveness")
    security = {**pod["securityContext"], **pod["containers"][0]["securityContext"]}
    assert container.process_ids() == (security["runAsUser"], security["runAsGroup"])

    spec = {
        "model": {"source": "/models/tiny", "loadFormat": "dummy"},
        "resources": {"gpus": 1, "requests": {"cpu": "1", "memory": "2Gi"}},
    }
    cluster.apply_yaml(
        {**llmserver("tiny", spec), "metadata": {"name": "tiny", "namespace": namespace}}
    )
    wait_ready(cluster, namespace, "tiny", 1)
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    policy = client.PolicyV1Api(cluster.api)
    assert apps.read_namespaced_deployment("tiny", namespace).status.ready_replicas == 1
    assert core.read_namespaced_service("tiny", namespace).spec.ports[0].port == 8000
    assert policy.read_namespaced_pod_disruption_budget("tiny", namespace) is not None

    container.signal("TERM")
    assert container.wait_exit() == 0, container.logs()[-4000:]
    logs = container.logs()
    # A whole-word 403: the log also names the webhook's free port, which may hold those digits.
    assert "Forbidden" not in logs and not re.search(r"\b403\b", logs), logs[-4000:]


def _noop_changes(
    cluster: Cluster, namespace: str, pod: dict[str, Any], images: dict[str, str], tmp_path: Path
) -> set[str]:
    """What the runtime itself changes in a container of this pod (its mount points)."""
    noop = dict(pod["containers"][0], command=["true"], args=[])
    args = operator_run_args(
        cluster, namespace, {**pod, "containers": [noop]}, images["operator"], tmp_path,
        read_only_root=False,
    )  # fmt: skip
    container = run_detached(f"pk-operator-noop-{uuid.uuid4().hex[:6]}", args)
    try:
        assert container.wait_exit() == 0, container.logs()
        return container.changes()
    finally:
        container.remove()
