"""An Alertmanager flood causes at most one action per server per cooldown, with real parts:
the local control plane (KWOK GPU nodes), the operator as a subprocess with its webhook, and a
real Alertmanager posting to it.

Alertmanager gets, through its own API, two alerts for each of the server's three pods and two
for a pod that was never there, sent again and again; it delivers them (one group per pod and
alert) and repeats them. Beside it, deliveries it would make only under failures are posted to
the webhook directly: the same notification by ten senders at once, and a resolved
notification overtaking its firing one. The cluster must see one eviction in all of it: one
pod with a DisruptionTarget, one `evict` record in status, one PodEvicted Event.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from harness.cluster import Cluster, wait_for
from harness.loop import (
    OperatorProcess,
    PodWatch,
    history,
    install_crd,
    llmserver,
    restrict_namespace,
    server_events,
    wait_ready_pods,
)
from harness.processes import Service, start_alertmanager
from tests.support.alerts import notification, post_notification, webhook_alert

SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": "tiny", "loadFormat": "dummy"},
    "replicas": 3,
    "resources": {"gpus": 1},
    "remediation": {"hysteresisSeconds": 0, "cooldownSeconds": 3600, "maxUnavailable": 1},
}
ALERTS = ("PagekeeperKVCacheSaturated", "PagekeeperFragmentationHigh")


def webhook_notifications(alertmanager: Service) -> float:
    """Notifications Alertmanager sent to the webhook, from its /metrics."""
    with urllib.request.urlopen(f"{alertmanager.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("alertmanager_notifications_total") and 'integration="webhook"' in line
    )


def send_to_alertmanager(alertmanager: Service, namespace: str, pods: list[str]) -> None:
    now = datetime.now(UTC)
    alerts = [
        {
            "labels": {"alertname": name, "namespace": namespace, "pod": pod, "llmserver": "f"},
            "startsAt": (now - timedelta(minutes=2)).isoformat(),
            "endsAt": (now + timedelta(minutes=10)).isoformat(),
        }
        for pod in pods
        for name in ALERTS
    ]
    request = urllib.request.Request(
        f"{alertmanager.url}/api/v2/alerts",
        data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_a_flood_of_alerts_evicts_one_pod_once(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    with contextlib.ExitStack() as stack:
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        pods = PodWatch(cluster.kubeconfig, namespace).start()
        stack.callback(pods.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver("f", SPEC)], "-n", namespace)
        names = wait_ready_pods(cluster, namespace, "f", 3)
        url, token = operator.webhook_url, operator.token

        # A resolved notification that overtook its firing one: the late firing does nothing.
        started = datetime.now(UTC) - timedelta(minutes=3)
        resolved = webhook_alert(
            namespace, names[0], "f", status="resolved", starts_at=started,
            ends_at=datetime.now(UTC), fingerprint="0000late",
        )  # fmt: skip
        late = webhook_alert(namespace, names[0], "f", starts_at=started, fingerprint="0000late")
        assert post_notification(url, token, notification(resolved))["decisions"][0]["reason"] == (
            "resolved"
        )
        assert post_notification(url, token, notification(late))["decisions"][0]["reason"] == (
            "resolved"
        )
        assert not history(cluster, namespace, "f")

        # The flood: through Alertmanager, and the same notification from ten senders at once.
        alertmanager = start_alertmanager(tmp_path / "alertmanager", url, token)
        stack.callback(alertmanager.stop)
        ghost = "f-5d8c7b9f4-gone0"  # a pod of the server that no longer exists
        for _ in range(5):
            send_to_alertmanager(alertmanager, namespace, [*names, ghost])
        burst = notification(
            *(
                webhook_alert(
                    namespace, pod, "f", name=name, starts_at=started, fingerprint=f"{i:04d}{j:04d}"
                )
                for i, pod in enumerate([*names, ghost])
                for j, name in enumerate(ALERTS)
            )
        )
        with ThreadPoolExecutor(max_workers=10) as senders:
            answers = list(senders.map(lambda _: post_notification(url, token, burst), range(10)))
        reasons = {d["reason"] for a in answers for d in a["decisions"]}
        assert {"duplicate", "unknown-pod"} <= reasons, reasons

        def evictions() -> list[dict[str, Any]]:
            return [r for r in history(cluster, namespace, "f") if r["action"] == "evict"]

        try:
            (evicted,) = wait_for(evictions, timeout=120, what="the eviction")
            # Alertmanager goes on delivering (every group once, then its repeats).
            sent = webhook_notifications(alertmanager)
            wait_for(
                lambda: webhook_notifications(alertmanager) >= sent + 2 * len(ALERTS) * 4,
                timeout=240,
                interval=2,
                what="Alertmanager's further deliveries",
            )
            wait_ready_pods(cluster, namespace, "f", 3, timeout=120)
        except AssertionError:
            print(operator.log_tail(8000))
            raise

    assert evicted["outcome"] == "evicted" and evicted["pod"] in names
    assert evictions() == [evicted]
    disrupted = [pod for pod in names if pods.disruption_of(pod)]
    assert disrupted == [evicted["pod"]]
    events = [e for e in server_events(cluster, namespace, "f") if e.reason == "PodEvicted"]
    assert len(events) == 1
    assert pods.error is None
