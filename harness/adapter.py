"""prometheus-adapter on loopback, registered with the local API server's aggregator as
custom.metrics.k8s.io/v1beta1, for the autoscaling e2e test and `make demo-autoscale`.

The adapter runs as a host process with the chart's rules (`charts/pagekeeper/adapter/
rules.yaml`), the cluster's admin kubeconfig to list pods and check callers, and the cluster's
CA as the request-header CA: kwokctl starts kube-apiserver with a proxy client certificate that
CA signed, which the aggregator presents when it forwards a request (with the caller in
X-Remote-User). The APIService names a Service of type ExternalName whose name is `localhost`:
without aggregator routing the API server dials an ExternalName Service at that name and the
APIService's port, so it reaches the host process although no pod network exists. The adapter's
serving certificate is self-signed for localhost, so the APIService skips TLS verification:
acceptable on a loopback test cluster only (a real install uses the adapter's own chart).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.cluster import Cluster, wait_for
from harness.processes import Service, free_port, wait_http_ok
from harness.tools import REPO, missing, tool

ADAPTER_RULES = REPO / "charts" / "pagekeeper" / "adapter" / "rules.yaml"
API_SERVICE = "v1beta1.custom.metrics.k8s.io"
SERVICE_NAME = "prometheus-adapter"
# How often the adapter looks for new series: a pod's series appear only once it is scraped.
RELIST_INTERVAL = "2s"


def cluster_ca(cluster: Cluster) -> Path:
    """The CA kwokctl made for the cluster (it signs the API server's proxy client cert)."""
    path = Path(cluster.kubeconfig).parent / "pki" / "ca.crt"
    if not path.is_file():
        missing(f"the cluster CA at {path} (a cluster from hack/cluster.sh)")
    return path


def start_adapter(cluster: Cluster, prometheus_url: str, workdir: Path) -> Service:
    """prometheus-adapter serving HTTPS on 127.0.0.1, reading `prometheus_url`."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    kubeconfig = cluster.kubeconfig
    argv = [
        tool("prometheus-adapter"),
        f"--secure-port={port}",
        "--bind-address=127.0.0.1",
        f"--cert-dir={workdir / 'certs'}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--requestheader-client-ca-file={cluster_ca(cluster)}",
        f"--prometheus-url={prometheus_url}",
        f"--metrics-relist-interval={RELIST_INTERVAL}",
        f"--config={ADAPTER_RULES}",
    ]
    log = workdir / "adapter.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=workdir)
    adapter = Service(name="prometheus-adapter", proc=proc, port=port, log=log)
    try:
        wait_http_ok(f"https://127.0.0.1:{port}/healthz", proc=proc, insecure=True)
    except (RuntimeError, TimeoutError) as exc:
        adapter.stop()
        raise RuntimeError(f"prometheus-adapter did not start: {exc}\n{log.read_text()}") from exc
    return adapter


def _registration(namespace: str, port: int) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE_NAME, "namespace": namespace},
            "spec": {"type": "ExternalName", "externalName": "localhost"},
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": API_SERVICE},
            "spec": {
                "service": {"namespace": namespace, "name": SERVICE_NAME, "port": port},
                "group": "custom.metrics.k8s.io",
                "version": "v1beta1",
                "insecureSkipTLSVerify": True,
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]


def _is_available(cluster: Cluster) -> bool:
    result = cluster.kubectl("get", "apiservice", API_SERVICE, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout).get("status", {}).get("conditions") or []
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def custom_metrics_api(cluster: Cluster, adapter: Service, namespace: str) -> Iterator[None]:
    """The adapter registered as custom.metrics.k8s.io while the block runs; the APIService
    (cluster-wide) is removed after it, so no later test sees an unavailable API group."""
    cluster.apply_yaml(_registration(namespace, adapter.port))
    try:
        wait_for(lambda: _is_available(cluster), timeout=60, what=f"APIService {API_SERVICE}")
        yield
    finally:
        cluster.kubectl("delete", "apiservice", API_SERVICE, "--ignore-not-found", "--wait=true")


def pod_metric(cluster: Cluster, namespace: str, metric: str) -> dict[str, str]:
    """Pod name -> value of a custom metric, as the HorizontalPodAutoscaler controller reads it."""
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/{metric}"
    result = cluster.kubectl("get", "--raw", path, check=False)
    if result.returncode != 0:
        return {}
    items = json.loads(result.stdout).get("items") or []
    return {item["describedObject"]["name"]: item["value"] for item in items}
