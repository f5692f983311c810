"""Rendering the alerts from spec.remediation: exact rules, objects and the runbook links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pagekeeper_operator.alerts.render import (
    ALERT_NAMES,
    ENGINE_CONTAINER,
    ENGINE_METRICS_USED,
    duration_seconds,
    quantity_bytes,
    render_alert_rules,
    render_prometheus_rule,
    render_rules_file,
)
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import CLUSTER_SERIES, TRIGGERS
from pagekeeper_operator.render.meta import CONTAINER_NAME

REPO = Path(__file__).resolve().parents[2]
SEL = '{namespace="prod", llmserver="chat"}'
BY = "by (namespace, pod, llmserver)"


def test_default_rules_exactly() -> None:
    rules = render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper")
    assert [r["alert"] for r in rules] == list(ALERT_NAMES)
    kv = rules[1]
    assert kv == {
        "alert": "PagekeeperKVCacheSaturated",
        "expr": f"max {BY} (vllm:kv_cache_usage_perc{SEL}) > 0.95",
        "for": "2m",
        "labels": {"severity": "warning", "pagekeeper_remediate": "true"},
        "annotations": {
            "summary": "KV cache nearly full on {{ $labels.namespace }}/{{ $labels.pod }}",
            "description": "KV cache usage is {{ $value | humanizePercentage }} "
            "(threshold 0.95) for 2m.",
            "runbook_url": "docs/runbook.md#pagekeeperkvcachesaturated",
        },
    }
    frag = rules[0]
    reserved = f"sum {BY} (pagekeeper_allocator_reserved_bytes{SEL})"
    unused = f"({reserved} - sum {BY} (pagekeeper_allocator_allocated_bytes{SEL}))"
    assert frag["expr"] == (
        f"{unused} / {reserved} > 0.25\nand on (namespace, pod, llmserver)\n{unused} > 1073741824"
    )
    assert frag["for"] == "10m"
    waiting = f"sum {BY} (vllm:num_requests_waiting{SEL})"
    running = f"sum {BY} (vllm:num_requests_running{SEL})"
    assert rules[2]["expr"] == (
        f"{waiting} > 3.0 * {running}\nand on (namespace, pod, llmserver)\n{waiting} > 0"
    )
    assert rules[3]["expr"] == (
        f"sum {BY} (min_over_time(vllm:num_requests_waiting{SEL}[5m])) > 0\n"
        f"and on (namespace, pod, llmserver)\nsum {BY} (vllm:num_requests_waiting{SEL} offset 5m)\n"
        f"unless on (namespace, pod, llmserver)\n"
        f"sum {BY} (increase(vllm:request_success_total{SEL}[5m])) > 0"
    )
    assert rules[3]["for"] == "0m"
    assert rules[3]["labels"]["severity"] == "critical"
    assert rules[4]["expr"] == f"sum {BY} (increase(pagekeeper_oom_events_total{SEL}[5m])) > 0"
    assert rules[4]["for"] == "0m"
    assert rules[5]["expr"] == (
        'max by (namespace, pod) (container_memory_working_set_bytes{namespace="prod", '
        'container="engine"})\n/ on (namespace, pod)\n'
        'max by (namespace, pod) (kube_pod_container_resource_limits{namespace="prod", '
        'container="engine", resource="memory"} > 0)\n'
        "* on (namespace, pod) group_left (llmserver)\n"
        f"group by (namespace, pod, llmserver) (up{SEL}) > 0.9"
    )
    assert (rules[5]["for"], rules[5]["labels"]["severity"]) == ("2m", "critical")
    assert rules[6]["expr"] == (
        f"sum {BY} (pagekeeper_kv_offload_bytes_used{SEL})\n> on (namespace, pod, llmserver)\n"
        f"sum {BY} (pagekeeper_kv_offload_bytes_capacity{SEL})"
    )
    assert (rules[6]["for"], rules[6]["labels"]["severity"]) == ("1m", "critical")


def test_the_host_memory_alert_selects_the_engine_container() -> None:
    assert ENGINE_CONTAINER == CONTAINER_NAME


def test_thresholds_and_durations_come_from_the_spec() -> None:
    spec = RemediationSpec.model_validate(
        {
            "triggers": {
                "fragmentation": {"threshold": 0.4, "minBytes": "512Mi", "for": "30m"},
                "kvCacheSaturation": {"threshold": 0.9, "for": "1m"},
                "queueBacklog": {"ratio": 5, "for": "10m"},
                "engineStalled": {"for": "15m"},
                "oomEvents": {"for": "1m"},
                "hostMemory": {"threshold": 0.8, "for": "30s"},
                "kvOffloadOverCapacity": {"for": "5m"},
            }
        }
    )
    rules = {r["alert"]: r for r in render_alert_rules("chat", "prod", spec, "pagekeeper")}
    assert rules["PagekeeperFragmentationHigh"]["expr"].endswith(" > 536870912")
    assert " > 0.4\n" in rules["PagekeeperFragmentationHigh"]["expr"]
    assert rules["PagekeeperFragmentationHigh"]["for"] == "30m"
    assert rules["PagekeeperKVCacheSaturated"]["expr"].endswith(" > 0.9")
    assert rules["PagekeeperKVCacheSaturated"]["for"] == "1m"
    assert " > 5.0 * " in rules["PagekeeperQueueBacklog"]["expr"]
    assert rules["PagekeeperQueueBacklog"]["for"] == "10m"
    assert rules["PagekeeperEngineStalled"]["expr"].count("[15m]") == 2
    assert "offset 15m" in rules["PagekeeperEngineStalled"]["expr"]
    assert rules["PagekeeperOOMEvents"]["for"] == "1m"
    assert rules["PagekeeperHostMemoryNearLimit"]["expr"].endswith(") > 0.8")
    assert rules["PagekeeperHostMemoryNearLimit"]["for"] == "30s"
    assert rules["PagekeeperKVOffloadOverCapacity"]["for"] == "5m"


def test_stall_window_has_a_minimum() -> None:
    spec = RemediationSpec.model_validate({"triggers": {"engineStalled": {"for": "0m"}}})
    [stalled] = [
        r for r in render_alert_rules("chat", "prod", spec, "pagekeeper") if "Stalled" in r["alert"]
    ]
    assert stalled["expr"].count("[1m]") == 2


def test_disabled_triggers_and_remediation() -> None:
    spec = RemediationSpec.model_validate(
        {"enabled": False, "triggers": {"fragmentation": {"enabled": False}}}
    )
    rules = render_alert_rules("chat", "prod", spec, "pagekeeper")
    assert [r["alert"] for r in rules] == list(ALERT_NAMES[1:])
    # Still notifying people, but not routed to the operator.
    assert {r["labels"]["pagekeeper_remediate"] for r in rules} == {"false"}
    everything_off = RemediationSpec.model_validate(
        {
            "triggers": {
                t: {"enabled": False}
                for t in (
                    "fragmentation",
                    "kvCacheSaturation",
                    "queueBacklog",
                    "engineStalled",
                    "oomEvents",
                    "hostMemory",
                    "kvOffloadOverCapacity",
                )
            }
        }
    )
    assert render_alert_rules("chat", "prod", everything_off, "pagekeeper") == []
    assert yaml.safe_load(render_rules_file("chat", "prod", everything_off, "pagekeeper")) == {
        "groups": []
    }


def test_prometheus_rule_object() -> None:
    owner = {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "name": "chat",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    rule = render_prometheus_rule("chat", "prod", RemediationSpec(), "pagekeeper", owner)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["metadata"] == {
        "name": "chat-memory-alerts",
        "namespace": "prod",
        "labels": {
            "app.kubernetes.io/managed-by": "pagekeeper",
            "app.kubernetes.io/component": "alerts",
            "pagekeeper.dev/llmserver": "chat",
        },
        "ownerReferences": [owner],
    }
    assert rule["spec"] == {
        "groups": [
            {
                "name": "pagekeeper.prod.chat",
                "rules": render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper"),
            }
        ]
    }
    assert (
        "ownerReferences"
        not in render_prometheus_rule("chat", "prod", RemediationSpec(), "pagekeeper", None)[
            "metadata"
        ]
    )


def test_rules_file_round_trips() -> None:
    text = render_rules_file("chat", "prod", RemediationSpec(), "pagekeeper")
    assert yaml.safe_load(text) == {
        "groups": [
            {
                "name": "pagekeeper.prod.chat",
                "rules": render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper"),
            }
        ]
    }
    # Multi-line expressions are literal blocks, as a person would write them.
    assert "    expr: |-\n" in text


def _series_read(expr: str) -> set[str]:
    return set(re.findall(r"\b([a-z_:][a-z0-9_:]*)\{", expr))


def test_each_alert_reads_exactly_the_series_its_trigger_lists() -> None:
    rules = render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper")
    assert {r["alert"]: _series_read(r["expr"]) for r in rules} == {
        t.alert: set(t.series) for t in TRIGGERS
    }
    engine_series = set().union(*(_series_read(r["expr"]) for r in rules)) - set(CLUSTER_SERIES)
    assert engine_series == set(ENGINE_METRICS_USED)
    assert "pagekeeper_kv_offload_bytes_used" in ENGINE_METRICS_USED


def test_vllm_gets_every_alert_but_the_host_tiers_through_pagekeepers_plugin() -> None:
    # vLLM's own offloading exports no tier series; the container's memory is the cluster's.
    pagekeeper = render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper")
    assert render_alert_rules("chat", "prod", RemediationSpec(), "vllm") == [
        r for r in pagekeeper if r["alert"] != "PagekeeperKVOffloadOverCapacity"
    ]


def test_vllm_without_the_plugin_gets_only_the_alerts_whose_series_it_exports() -> None:
    rules = render_alert_rules("chat", "prod", RemediationSpec(), "vllm", has_plugin=False)
    assert [r["alert"] for r in rules] == [
        "PagekeeperKVCacheSaturated",
        "PagekeeperQueueBacklog",
        "PagekeeperEngineStalled",
        "PagekeeperHostMemoryNearLimit",
    ]
    assert all(
        name.startswith("vllm:") or name in CLUSTER_SERIES
        for r in rules
        for name in _series_read(r["expr"])
    )
    # The same thresholds as for the paged engine: only the missing series decide.
    pagekeeper = render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper")
    assert rules == [r for r in pagekeeper if r["alert"] in {r["alert"] for r in rules}]


def test_runbook_has_a_section_per_alert() -> None:
    runbook = (REPO / "docs" / "runbook.md").read_text()
    headings = re.findall(r"^## (\S+)\s*$", runbook, flags=re.MULTILINE)
    assert [h for h in headings if h.startswith("Pagekeeper")] == list(ALERT_NAMES)
    for rule in render_alert_rules("chat", "prod", RemediationSpec(), "pagekeeper"):
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == rule["alert"].lower()


@pytest.mark.parametrize(
    ("quantity", "num_bytes"),
    [
        ("1Gi", 1 << 30),
        ("1.5Gi", 3 << 29),
        ("512Mi", 1 << 29),
        ("2G", 2_000_000_000),
        ("100k", 100_000),
        ("1073741824", 1 << 30),
        (".5Ki", 512),
        ("0", 0),
        ("1.0001k", 1001),  # rounded up to whole bytes
    ],
)
def test_quantity_bytes(quantity: str, num_bytes: int) -> None:
    assert quantity_bytes(quantity) == num_bytes


@pytest.mark.parametrize(
    ("duration", "seconds"),
    [("0", 0.0), ("0m", 0.0), ("90s", 90.0), ("1h30m", 5400.0), ("1d", 86400.0), ("250ms", 0.25)],
)
def test_duration_seconds(duration: str, seconds: float) -> None:
    assert duration_seconds(duration) == seconds


def test_spec_refuses_bad_durations_and_bounds() -> None:
    for bad in (
        {"triggers": {"kvCacheSaturation": {"for": "2 minutes"}}},
        {"triggers": {"kvCacheSaturation": {"for": ""}}},
        {"triggers": {"kvCacheSaturation": {"threshold": 1.5}}},
        {"triggers": {"fragmentation": {"minBytes": "1GB"}}},
        {"historyLimit": 101},
        {"maxUnavailable": 0},
        {"adaptive": {"maxNumBatchedTokensStep": 1.0}},
    ):
        with pytest.raises(ValueError, match="validation error"):
            RemediationSpec.model_validate(bad)
