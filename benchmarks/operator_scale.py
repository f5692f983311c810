"""Operator scale on the local control plane (docs/benchmarks.md, "Operator scale").

For each N: apply N LLMServers at once and time until every Deployment is Available (KWOK makes
the pods Ready); then let the operator resync twice with nothing to change and count the API
writes it makes to LLMServers and their children (the API server's own request counter); and
read the operator's resident memory.

    python benchmarks/operator_scale.py --sizes 10 100 1000 --resync-seconds 30
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from kubernetes import client

from harness.cluster import Cluster, start_cluster
from harness.operator_process import CRD_PATH, OperatorProcess

WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE"}
OWNED = {
    "llmservers",
    "deployments",
    "services",
    "poddisruptionbudgets",
    "servicemonitors",
    "prometheusrules",
}
_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def api_writes(cluster: Cluster) -> Counter[str]:
    """Write requests served so far for LLMServers and their children, by verb/resource/sub."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if labels.get("verb") in WRITE_VERBS and labels.get("resource") in OWNED:
            key = f"{labels['verb']} {labels['resource']}/{labels.get('subresource', '')}"
            counts[key] += int(float(match.group("value")))
    return counts


def server(name: str) -> dict[str, object]:
    return {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "/models/m"},
            "replicas": 1,
            "resources": {"gpus": 0, "requests": {"cpu": "10m", "memory": "64Mi"}},
        },
    }


# One large fake node, so a thousand single-pod servers schedule (the GPU nodes hold 110 each).
SCALE_NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": "kwok-scale-0",
        "annotations": {"kwok.x-k8s.io/node": "fake"},
        "labels": {"kubernetes.io/hostname": "kwok-scale-0", "type": "kwok"},
    },
    "status": {
        "allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "5000"},
        "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "5000"},
    },
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def run_size(
    cluster: Cluster, size: int, log_dir: Path, timeout: float, resync: float
) -> dict[str, float]:
    namespace = f"scale-{size}"
    cluster.kubectl("create", "namespace", namespace)
    operator = OperatorProcess(cluster, namespace, log_dir, resync_seconds=resync)
    operator.start()
    try:
        docs = [server(f"s{i:04d}") for i in range(size)]
        apps = client.AppsV1Api(cluster.api)
        start = time.monotonic()
        cluster.kubectl(
            "apply",
            "--server-side",
            "-n",
            namespace,
            "-f",
            "-",
            input=yaml.safe_dump_all(docs),
            timeout=600,
        )
        available = 0
        while time.monotonic() - start < timeout:
            deployments = apps.list_namespaced_deployment(namespace).items
            available = sum(1 for d in deployments if (d.status.available_replicas or 0) >= 1)
            if available == size:
                break
            time.sleep(2.0)  # listing 1000 Deployments is not free on 2 cores
        elapsed = time.monotonic() - start
        assert available == size, f"{available}/{size} Available after {timeout}s"
        time.sleep(resync)  # let the creation settle, status included
        before = api_writes(cluster)
        time.sleep(3 * resync)  # three resyncs of every server, nothing to change
        writes = api_writes(cluster)
        writes.subtract(before)
        num_writes = sum(writes.values())
        if num_writes:
            print(f"  writes while idle: {dict(+writes)}", flush=True)
        assert operator.process is not None
        return {
            "servers": size,
            "seconds_to_available": round(elapsed, 1),
            "noop_writes_per_reconcile": round(num_writes / (size * 3), 3),
            "operator_rss_mib": round(rss_mib(operator.process.pid), 1),
        }
    finally:
        operator.stop()
        # Wait for the namespace to go, so its deletion does not count in the next size's writes.
        cluster.kubectl("delete", "namespace", namespace, "--timeout=900s", timeout=960)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--resync-seconds", type=float, default=30, help="the operator's PAGEKEEPER_RESYNC_SECONDS"
    )
    args = parser.parse_args()
    clusters = start_cluster()
    cluster = next(clusters)
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
        cluster.apply_yaml(SCALE_NODE)
        cluster.wait_established("llmservers.pagekeeper.dev")
        with tempfile.TemporaryDirectory() as tmp:
            for size in args.sizes:
                print(
                    run_size(cluster, size, Path(tmp), args.timeout, args.resync_seconds),
                    flush=True,
                )
    finally:
        clusters.close()


if __name__ == "__main__":
    main()
