"""The crash harness's moving parts: the operator killed at a fault point and restarted, the
Alertmanager side of the webhook (re-sending what fires, as Alertmanager does on every
`repeat_interval` and after a failed delivery), and the pods' availability replayed from a watch.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import OperatorProcess, PodWatch, get_server
from pagekeeper_operator.faultpoints import FAULT_POINT_ENV, FaultPoint
from pagekeeper_operator.render.meta import SERVER_LABEL

# The operator re-plans every server this often (the least the settings accept).
RESYNC_SECONDS = 5
# How long a run may take to reach its fault point (the scenario's steps on a busy machine).
REACH_TIMEOUT = 180.0
# The bound in which status must match the cluster after the restart (docs/crash-consistency.md):
# a few resync rounds and the Deployment controller's and KWOK's work.
CONVERGE_TIMEOUT = 120.0
# Alertmanager re-sends a group this often here (its repeat_interval; 4h by default).
RESEND_SECONDS = 1.0


class Operator:
    """The operator of one namespace across its lives: one armed with a fault point, then
    clean ones; each life is a fresh `kopf run` process with its own webhook port and token."""

    def __init__(
        self, cluster: Cluster, namespace: str, workdir: Path, env: Mapping[str, str]
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.workdir = workdir
        self.env = {"PAGEKEEPER_RESYNC_SECONDS": str(RESYNC_SECONDS), **env}
        self.lives: list[OperatorProcess] = []

    @property
    def current(self) -> OperatorProcess:
        assert self.lives, "start() first"
        return self.lives[-1]

    def start(self, fault: str | None = None) -> OperatorProcess:
        assert not self.lives or self.current.proc.poll() is not None, "still running"
        env = dict(self.env)
        if fault is not None:
            env[FAULT_POINT_ENV] = fault
        life = OperatorProcess(
            self.cluster.kubeconfig,
            self.namespace,
            self.workdir / f"life-{len(self.lives)}",
            extra_env=env,
        )
        self.lives.append(life)
        life.wait_ready()
        return life

    def wait_killed_at(self, point: FaultPoint, nth: int, timeout: float = REACH_TIMEOUT) -> None:
        """Until the armed life SIGKILLed itself at `point`, and there."""
        life = self.current
        line = f"pagekeeper fault point {point}:{nth} reached"
        wait_for(
            lambda: life.proc.poll() is not None,
            timeout=timeout,
            what=f"the operator killed at {point}:{nth}\n{life.log_tail()}",
        )
        assert life.proc.returncode == -9, f"exited {life.proc.returncode}\n{life.log_tail()}"
        assert line in life.log.read_text(errors="replace"), life.log_tail()

    def stop(self) -> None:
        for life in self.lives:
            life.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- life {i} ---\n{life.log_tail(6000)}" for i, life in enumerate(self.lives)
        )


def firing_alert(
    namespace: str, pod: str, server: str, fingerprint: str, starts_at: datetime
) -> dict[str, Any]:
    """One firing alert of a pod, as Alertmanager's webhook carries it."""
    return {
        "status": "firing",
        "labels": {
            "alertname": "PagekeeperKVCacheSaturated",
            "namespace": namespace,
            "pod": pod,
            "llmserver": server,
            "pagekeeper_remediate": "true",
        },
        "startsAt": starts_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": fingerprint,
    }


def minutes_ago(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


@dataclass
class AlertSender:
    """Alertmanager's side: every RESEND_SECONDS, each group of firing alerts is posted to
    the operator's current webhook; a refused or failed delivery is simply tried again."""

    operator: Operator
    groups: list[list[dict[str, Any]]] = field(default_factory=list)
    num_delivered: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def fire(self, *alerts: dict[str, Any]) -> None:
        """Add one group (one notification) of alerts."""
        with self._lock:
            self.groups.append(list(alerts))

    def _post(self, alerts: list[dict[str, Any]]) -> None:
        life = self.operator.current
        body = {
            "version": "4",
            "groupKey": "{}:{crash}",
            "status": "firing",
            "receiver": "pagekeeper",
            "alerts": alerts,
        }
        request = urllib.request.Request(
            life.webhook_url, data=json.dumps(body).encode(), method="POST"
        )
        request.add_header("Content-Type", "application/json")
        request.add_header("Authorization", f"Bearer {life.token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    self.num_delivered += 1
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # the operator is down or failed: Alertmanager retries

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                groups = [list(group) for group in self.groups]
            for group in groups:
                self._post(group)
            self._stop.wait(RESEND_SECONDS)

    def start(self) -> AlertSender:
        self._thread = threading.Thread(target=self._run, name="alert-sender", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


def _is_serving(pod: client.V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    is_ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return is_ready and pod.metadata.deletion_timestamp is None


def serving_timeline(watch: PodWatch, server: str) -> list[tuple[int, str, str]]:
    """(pods serving, event, pod) after each event the watch saw of the server's pods (ready
    and not terminating; canary pods count too)."""
    serving: dict[str, bool] = {}
    timeline = []
    for kind, pod in list(watch.seen):
        if (pod.metadata.labels or {}).get(SERVER_LABEL) != server:
            continue
        serving[pod.metadata.name] = kind != "DELETED" and _is_serving(pod)
        timeline.append((sum(serving.values()), kind, pod.metadata.name))
    return timeline


def assert_serving(watch: PodWatch, server: str, replicas: int, at_least: int) -> int:
    """The fewest pods serving at any moment after all `replicas` first served (the watch's
    first events list them one by one); fails with the timeline when below `at_least`."""
    timeline = serving_timeline(watch, server)
    start = next(i for i, (count, _, _) in enumerate(timeline) if count >= replicas)
    fewest = min(count for count, _, _ in timeline[start:])
    assert fewest >= at_least, f"only {fewest} pods served (at least {at_least}): {timeline}"
    return fewest


def evicted_pods(watch: PodWatch) -> list[str]:
    """Pods the Eviction API took (the DisruptionTarget condition the API server sets)."""
    names = {pod.metadata.name for _, pod in list(watch.seen)}
    return sorted(name for name in names if watch.disruption_of(name) is not None)


def deleted_pods(watch: PodWatch, names: set[str]) -> set[str]:
    return {name for name in names if watch.was_deleted(name)}


def status_of(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_server(cluster, namespace, name).get("status") or {}
    return status


@contextmanager
def pod_watch(cluster: Cluster, namespace: str) -> Iterator[PodWatch]:
    watch = PodWatch(cluster.kubeconfig, namespace).start()
    try:
        yield watch
    finally:
        watch.stop()
    assert watch.error is None, f"the pod watch broke: {watch.error}"


def timed(condition: Callable[[], Any], timeout: float, what: str) -> tuple[Any, float]:
    """`wait_for(condition)` and the seconds it took (reported, never asserted on)."""
    began = time.monotonic()
    value = wait_for(condition, timeout=timeout, interval=0.5, what=what)
    return value, time.monotonic() - began
