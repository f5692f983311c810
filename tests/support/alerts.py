"""Alertmanager's webhook notifications (version 4) as it posts them, for tests that drive the
operator's webhook directly: floods, repeats and out-of-order deliveries that real Alertmanager
produces only under failures."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

from harness.cluster import wait_for

ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of a firing alert


def stamp(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def webhook_alert(
    namespace: str,
    pod: str,
    server: str,
    *,
    name: str = "PagekeeperKVCacheSaturated",
    status: str = "firing",
    starts_at: datetime,
    ends_at: datetime | None = None,
    fingerprint: str,
) -> dict[str, Any]:
    """One alert of a notification, labelled as the operator's rules label theirs."""
    return {
        "status": status,
        "labels": {
            "alertname": name,
            "namespace": namespace,
            "pod": pod,
            "llmserver": server,
            "pagekeeper_remediate": "true",
        },
        "annotations": {"summary": f"{name} on {namespace}/{pod}"},
        "startsAt": stamp(starts_at),
        "endsAt": ZERO_TIME if ends_at is None else stamp(ends_at),
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint,
    }


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    is_firing = any(a["status"] == "firing" for a in alerts)
    return {
        "version": "4",
        "groupKey": "{}:{}",
        "truncatedAlerts": 0,
        "status": "firing" if is_firing else "resolved",
        "receiver": "pagekeeper",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }


def post_notification(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST as Alertmanager does; the webhook's JSON answer (an HTTP error raises)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def deliver_notification(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST until the webhook answers, retrying a 5xx as Alertmanager does (a 4xx raises)."""

    def attempt() -> dict[str, Any] | None:
        try:
            return post_notification(url, token, body)
        except urllib.error.HTTPError as error:
            if error.code < 500:
                raise
            return None

    answer: dict[str, Any] = wait_for(attempt, timeout=120, interval=1, what="a 2xx answer")
    return answer
