"""The operator's remediation counter follows the records it appends to status."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_operator.metrics import REGISTRY, serve_metrics
from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.remediator import Remediator
from tests.operator.remediation_fakes import Clock, FakeCluster, alert_json, message_json
from tests.support.processes import free_port

KV = "PagekeeperKVCacheSaturated"


def _count(action: str, outcome: str) -> float:
    labels = {"namespace": "prod", "llmserver": "chat", "alert": KV}
    value = REGISTRY.get_sample_value(
        "pagekeeper_remediations_total", {**labels, "action": action, "outcome": outcome}
    )
    return value or 0.0


def test_each_appended_record_is_counted_once() -> None:
    cluster = FakeCluster(["chat-a", "chat-b"], is_pdb_blocking=True)
    clock = Clock()
    remediator = Remediator(cluster, clock=clock)
    blocked, evicted = _count("evict", "pdb-blocked"), _count("evict", "evicted")

    message = WebhookMessage.model_validate(message_json(alert_json("chat-a")))
    asyncio.run(remediator.handle(message))
    clock.advance(15)
    asyncio.run(remediator.retry_due())  # refused again: recorded once, counted once
    assert _count("evict", "pdb-blocked") == blocked + 1

    cluster.is_pdb_blocking = False
    clock.advance(15)
    asyncio.run(remediator.retry_due())
    assert _count("evict", "evicted") == evicted + 1
    assert len(cluster.history) == 2


def test_metrics_endpoint_serves_the_counter() -> None:
    port = free_port()
    serve_metrics(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "pagekeeper_remediations" in names
