"""The API server restarts under the operator in the middle of a rollout it started.

A control plane of its own (the test stops its kube-apiserver process and starts it again on
the same port and etcd, `tests/support/control_plane.py`), the operator as a subprocess with
kopf's debug log. A policy change of a two-replica server is applied and the API server is
restarted at once, while the operator reconciles the change and the Deployment rolls.

What must hold: the operator survives (its process never exits; kopf's watches reconnect, and
resuming from a resourceVersion the new API server's watch cache does not hold is answered
410 Gone, which kopf takes as "list again"); the change rolls exactly once (Deployment
revision 2, two ReplicaSets, the old one at 0); never more pods unavailable than the rollout
allows; nothing is evicted; status converges to the new generation; and a later spec change is
still seen (the watch works after the restart).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, start_cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import CRD_PATH, OperatorProcess
from tests.integration.operator_fixture import apply_server, get_server, wait_ready
from tests.support.control_plane import ControlPlane

SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 2,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "rollout": {"maxSurge": 0, "maxUnavailable": 1},
}
REVISION = "deployment.kubernetes.io/revision"
# kopf's debug line when a watch resumed from a resourceVersion the API server no longer has
# (an ERROR event with code 410 in the stream): it lists again.
WATCH_RESTARTED = "Restarting the watch-stream for llmservers.v1alpha1.pagekeeper.dev"


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[Cluster]:
    """A control plane only this module's tests restart."""
    yield from start_cluster(fresh=True)


@pytest.fixture
def control_plane(own_cluster: Cluster) -> Iterator[ControlPlane]:
    processes = ControlPlane(own_cluster)
    try:
        yield processes
    finally:
        processes.close()


class AvailabilityWatch:
    """The fewest ready, not terminating pods of a server seen by polling from a thread (the
    API server's outage reads as no sample, not as zero pods)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.core = client.CoreV1Api(cluster.api)
        self.namespace, self.name = namespace, name
        self.fewest_ready: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                pods = self.core.list_namespaced_pod(
                    self.namespace, label_selector=f"pagekeeper.dev/llmserver={self.name}"
                ).items
            except (ApiException, OSError, urllib3.exceptions.HTTPError):  # restarting
                continue
            ready = sum(
                1
                for p in pods
                if p.metadata.deletion_timestamp is None
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            )
            if self.fewest_ready is None or ready < self.fewest_ready:
                self.fewest_ready = ready

    def __enter__(self) -> AvailabilityWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def replica_sets(cluster: Cluster, namespace: str) -> dict[str, int]:
    items = client.AppsV1Api(cluster.api).list_namespaced_replica_set(namespace).items
    return {rs.metadata.name: rs.spec.replicas for rs in items}


def test_the_operator_survives_an_api_server_restart_mid_rollout_with_one_rollout(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cluster = control_plane.cluster
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    cluster.wait_established("llmservers.pagekeeper.dev")
    namespace = "restart"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )  # fmt: skip
    operator = OperatorProcess(cluster, namespace, tmp_path, extra_args=("--debug",))
    operator.start()
    apps = client.AppsV1Api(cluster.api)
    try:
        apply_server(cluster, namespace, llmserver("m", SPEC))
        wait_ready(cluster, namespace, "m", 2)
        before = apps.read_namespaced_deployment("m", namespace)
        assert before.metadata.annotations[REVISION] == "1"
        (first_rs,) = replica_sets(cluster, namespace)

        changed = copy.deepcopy(SPEC)
        changed["memoryPolicy"]["gpuMemoryUtilization"] = 0.85
        with AvailabilityWatch(cluster, namespace, "m") as availability:
            apply_server(cluster, namespace, llmserver("m", changed))
            control_plane.restart_api_server()
            assert operator.process is not None and operator.process.poll() is None, (
                f"the operator exited:\n{operator.log()[-4000:]}"
            )
            obj = wait_ready(cluster, namespace, "m", 2, timeout=240)

            def rolled() -> bool:
                deployment = apps.read_namespaced_deployment("m", namespace)
                sets = replica_sets(cluster, namespace)
                return (
                    deployment.status.updated_replicas == 2
                    and deployment.status.ready_replicas == 2
                    and sets.get(first_rs) == 0
                )

            wait_for(rolled, timeout=180, what="the rollout finished")
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2
        after = apps.read_namespaced_deployment("m", namespace)
        assert after.metadata.annotations[REVISION] == "2", "exactly one rollout"
        assert after.metadata.generation == before.metadata.generation + 1
        sets = replica_sets(cluster, namespace)
        assert len(sets) == 2 and sets[first_rs] == 0, sets
        assert availability.fewest_ready is not None
        assert availability.fewest_ready >= 2 - SPEC["rollout"]["maxUnavailable"]
        assert not get_server(cluster, namespace, "m")["status"].get("remediationHistory")

        # The watch works after the restart: a change that rolls nothing is still reconciled.
        changed["remediation"] = {"cooldownSeconds": 900}
        apply_server(cluster, namespace, llmserver("m", changed))
        obj = wait_ready(cluster, namespace, "m", 2, timeout=120)
        assert obj["status"]["observedGeneration"] == 3
        final = apps.read_namespaced_deployment("m", namespace)
        assert final.metadata.annotations[REVISION] == "2"
        assert len(replica_sets(cluster, namespace)) == 2
        assert operator.process is not None and operator.process.poll() is None
        assert WATCH_RESTARTED in operator.log(), "the restart did not expire the watch (410)"
    except AssertionError:
        print(operator.log()[-8000:])
        raise
    finally:
        operator.stop()
