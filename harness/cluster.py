"""A real local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import kubernetes
import yaml
from kubernetes.client import ApiClient

from harness.tools import BIN, CACHE, REPO, tool

T = TypeVar("T")
PROMETHEUS_OPERATOR_CRDS = sorted(
    CACHE.glob("crds/prometheus-operator-*/monitoring.coreos.com_*.yaml")
)


@dataclass
class Cluster:
    """Handle on a running cluster: its kubeconfig, an API client and a kubectl runner."""

    name: str
    kubeconfig: str
    api: ApiClient
    owned: bool  # created by this test session, so torn down by it
    crds_dir: Path = field(default=REPO / "crds")

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", self.kubeconfig, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
            )
        return result

    def apply_yaml(self, docs: list[dict[str, object]] | dict[str, object], *args: str) -> str:
        items = docs if isinstance(docs, list) else [docs]
        text = yaml.safe_dump_all(items, sort_keys=False)
        return self.kubectl("apply", "--server-side", *args, "-f", "-", input=text).stdout

    def wait_established(self, crd_name: str, timeout: float = 60) -> None:
        self.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd_name}", f"--timeout={int(timeout)}s"
        )


def _hack(*args: str) -> str:
    env = {**os.environ, "PAGEKEEPER_CACHE": str(CACHE)}
    result = subprocess.run(
        ["bash", str(REPO / "hack" / "cluster.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return result.stdout.strip()


def start_cluster(fresh: bool = False) -> Iterator[Cluster]:
    """Use $PAGEKEEPER_KUBECONFIG when set (a cluster left up by `make cluster`), else make one;
    `fresh` always makes one (a test that restarts the control plane's processes)."""
    for name in (
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
        "kwokctl",
    ):
        tool(name)
    tool("kubectl")
    existing = None if fresh else os.environ.get("PAGEKEEPER_KUBECONFIG")
    if existing:
        name, kubeconfig, owned = "external", existing, False
    else:
        name = f"pk-test-{uuid.uuid4().hex[:6]}"
        kubeconfig, owned = _hack("up", name), True
    api = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig
    )
    cluster = Cluster(name=name, kubeconfig=kubeconfig, api=api, owned=owned)
    try:
        for path in PROMETHEUS_OPERATOR_CRDS:
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        for path in PROMETHEUS_OPERATOR_CRDS:
            crd = yaml.safe_load(path.read_text())
            cluster.wait_established(crd["metadata"]["name"])
        yield cluster
    finally:
        api.close()
        if owned:
            _hack("down", name)


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = 60,
    interval: float = 0.5,
    what: str = "condition",
) -> T:
    """Poll `predicate` until it returns a truthy value; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


__all__ = ["BIN", "PROMETHEUS_OPERATOR_CRDS", "Cluster", "start_cluster", "wait_for"]
