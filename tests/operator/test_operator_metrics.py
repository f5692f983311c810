"""The operator's series: the remediation counter follows the records it appends to status,
the tuning series follow status.recommendations and the tuner's decisions."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.processes import free_port
from pagekeeper_operator.api.tuning import Recommendation, TuningSpec
from pagekeeper_operator.metrics import REGISTRY, count_tuning, serve_metrics
from pagekeeper_operator.remediation.payload import WebhookMessage
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.tuning.decide import TuningEvent
from tests.operator.remediation_fakes import Clock, FakeCluster, alert_json, message_json

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


def test_tuning_series_follow_the_recommendations_and_count_decisions() -> None:
    server = {"namespace": "prod", "llmserver": "tuned"}
    rec = Recommendation(
        field="maxNumSeqs", current="16", proposed="32", rule="max-num-seqs-up",
        expected_effect="x", confidence=0.75, since="2026-11-29T01:00:00Z",
    )  # fmt: skip
    labels = {**server, "field": "maxNumSeqs", "proposed": "32", "rule": "max-num-seqs-up"}
    started = TuningEvent("Normal", "TuningTrialStarted", "m")
    reason = {**server, "reason": "TuningTrialStarted"}
    before = REGISTRY.get_sample_value("pagekeeper_tuning_decisions_total", reason) or 0.0
    count_tuning("prod", "tuned", [rec], [started.reason])
    assert REGISTRY.get_sample_value("pagekeeper_tuning_recommendation", labels) == 0.75
    assert REGISTRY.get_sample_value("pagekeeper_tuning_decisions_total", reason) == before + 1
    count_tuning("prod", "tuned", [], [])  # the recommendation went away
    assert REGISTRY.get_sample_value("pagekeeper_tuning_recommendation", labels) is None


def test_the_tuning_spec_names_only_series_the_operator_serves() -> None:
    """`kubectl explain llmserver.spec.tuning` points at series that exist (a name that drifted
    from `metrics.py` would send a person to query nothing)."""
    served = {family.name for family in REGISTRY.collect()}
    text = " ".join(str(f.description) for f in TuningSpec.model_fields.values())
    named = set(re.findall(r"pagekeeper_[a-z_]+", text))
    assert named == {"pagekeeper_tuning_recommendation"}
    assert named <= served


def test_the_decisions_help_names_every_reason_the_tuner_posts() -> None:
    """Each Event reason the tuner's modules post is a value of the counter's `reason` label: the
    help text names them all (Inconclusive and extended trials among them)."""
    tuning = Path(__file__).parents[2] / "operator" / "pagekeeper_operator" / "tuning"
    posted = {
        reason
        for path in tuning.glob("*.py")
        for reason in re.findall(
            r'TuningEvent\(\s*"(?:Normal|Warning)",\s*"(\w+)"', path.read_text()
        )
    }
    assert {"TuningTrialExtended", "TuningTrialInconclusive", "TuningPromoted"} <= posted
    [family] = [f for f in REGISTRY.collect() if f.name == "pagekeeper_tuning_decisions"]
    assert {r for r in posted if r not in family.documentation} == set()
