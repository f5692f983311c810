"""409 Conflicts on the operator's status writes, produced for real, change nothing it does.

A second writer keeps changing the LLMServer (an annotation, as `kubectl annotate` or another
controller would) while the operator rolls a policy change and evicts a pod for an alert posted
to its webhook. Each of those writes moves the object's resourceVersion, so the operator's
status writes made under optimistic concurrency (the remediation history, the status refreshed
from Deployment events) are answered 409 by the API server: its own request counter shows
them. What must hold: one rollout (Deployment revision 2), one eviction with exactly one
history record and one Event, and status converged to the last generation once the writer
stops.
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from harness.cluster import Cluster, wait_for
from harness.loop import (
    OperatorProcess,
    PodWatch,
    get_server,
    history,
    install_crd,
    llmserver,
    restrict_namespace,
    server_events,
    wait_ready_pods,
)
from tests.support.alerts import deliver_notification, notification, webhook_alert

GROUP, VERSION, PLURAL = "pagekeeper.dev", "v1alpha1", "llmservers"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 3,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    "remediation": {"hysteresisSeconds": 0, "cooldownSeconds": 3600},
}
REVISION = "deployment.kubernetes.io/revision"
_CONFLICTS = re.compile(
    r'^apiserver_request_total\{(?=[^}]*code="409")(?=[^}]*resource="llmservers")'
    r'(?=[^}]*subresource="status")[^}]*\} (\S+)$',
    re.MULTILINE,
)


def status_conflicts(cluster: Cluster) -> float:
    """409 answers the API server gave to LLMServer status writes, from its own /metrics."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(float(value) for value in _CONFLICTS.findall(text))


class Churn:
    """Another writer of the LLMServer: an annotation changed as fast as the API takes it."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.api = client.CustomObjectsApi(cluster.api)
        self.namespace, self.name = namespace, name
        self.num_writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            body = {
                "metadata": {"annotations": {"test.pagekeeper.dev/churn": str(self.num_writes)}}
            }
            with contextlib.suppress(ApiException):
                self.api.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.name, body
                )
                self.num_writes += 1

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_status_write_conflicts_cause_no_extra_rollout_and_no_lost_or_doubled_record(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
    pods = PodWatch(cluster.kubeconfig, namespace).start()
    try:
        operator.wait_ready()
        cluster.apply_yaml([llmserver("m", SPEC)], "-n", namespace)
        first = wait_ready_pods(cluster, namespace, "m", 3)
        conflicts_before = status_conflicts(cluster)

        with Churn(cluster, namespace, "m") as churn:
            changed = copy.deepcopy(SPEC)
            changed["memoryPolicy"]["gpuMemoryUtilization"] = 0.85
            cluster.apply_yaml([llmserver("m", changed)], "-n", namespace)
            rolled = wait_for(
                lambda: (
                    (names := wait_ready_pods(cluster, namespace, "m", 3, timeout=240))
                    and not set(names) & set(first)
                    and names
                ),
                timeout=240,
                what="every pod replaced by the rollout",
            )
            target = rolled[0]
            started = datetime.now(UTC) - timedelta(minutes=1)
            alert = webhook_alert(namespace, target, "m", starts_at=started, fingerprint="c0ffee01")
            # an eviction's intent refused by the conflicts fails the delivery (nothing is
            # evicted); Alertmanager retries it, as this does
            answer = deliver_notification(operator.webhook_url, operator.token, notification(alert))
            assert answer["decisions"][0]["verdict"] == "evict", answer
            wait_for(
                lambda: status_conflicts(cluster) > conflicts_before,
                timeout=180,
                what="a 409 to an LLMServer status write",
            )
            assert churn.num_writes > 0

        def converged() -> dict[str, Any] | None:
            obj = get_server(cluster, namespace, "m")
            status = obj.get("status") or {}
            # the eviction's intent is on record before it; its outcome replaces it, written
            # later (the operator's retry) when the conflicts refused it at first
            records = [
                r
                for r in status.get("remediationHistory", [])
                if r["pod"] == target and r["outcome"] != "evicting"
            ]
            ready = {c["type"]: c["status"] for c in status.get("conditions", [])}.get("Ready")
            if (
                status.get("observedGeneration") == obj["metadata"]["generation"]
                and ready == "True"
                and status.get("readyReplicas") == 3
                and records
            ):
                return obj
            return None

        wait_for(converged, timeout=180, interval=1, what="status converged after the conflicts")
        wait_ready_pods(cluster, namespace, "m", 3, timeout=120)
        assert [
            (r["pod"], r["action"], r["outcome"]) for r in history(cluster, namespace, "m")
        ] == [(target, "evict", "evicted")]
        evicted = [e for e in server_events(cluster, namespace, "m") if e.reason == "PodEvicted"]
        assert len(evicted) == 1, [e.message for e in evicted]
        pods.wait_seen(lambda w: w.disruption_of(target), f"{target}'s eviction")
        assert [p for p in rolled if pods.disruption_of(p)] == [target]
        deployment = apps.read_namespaced_deployment("m", namespace)
        assert deployment.metadata.annotations[REVISION] == "2", "exactly one rollout"
        assert operator.proc.poll() is None
    except AssertionError:
        print(operator.log_tail(8000))
        raise
    finally:
        pods.stop()
        operator.stop()
    assert pods.error is None
