"""The host-memory alerts under promtool: the engine container's working set against its limit
(the cluster's cAdvisor and kube-state-metrics series, labelled with the pod's `llmserver`
through its scrape target) and the host KV tier above its capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pagekeeper_operator.alerts.render import render_rules_file
from pagekeeper_operator.api.remediation import RemediationSpec
from tests.operator.alerts.test_promtool import (
    GIB,
    NS,
    POD,
    SERVER,
    case,
    fired,
    promtool,
    run,
    series,
)

OTHER_POD = "chat-6d8f7c9b5-p9z7d"
LIMIT = 64 * GIB


def cadvisor(values: str, pod: str = POD, container: str = "engine") -> dict[str, str]:
    labels = {
        "namespace": NS,
        "pod": pod,
        "container": container,
        "id": f"/kubepods/burstable/{pod}/{container}",
        "image": "pagekeeper-engine",
    }
    text = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"container_memory_working_set_bytes{{{text}}}", "values": values}


def limit(values: str, pod: str = POD, resource: str = "memory") -> dict[str, str]:
    unit = "byte" if resource == "memory" else "core"
    text = (
        f'namespace="{NS}", pod="{pod}", container="engine", resource="{resource}", '
        f'unit="{unit}", node="gpu-1"'
    )
    return {"series": f"kube_pod_container_resource_limits{{{text}}}", "values": values}


def target(pod: str = POD, port: str = "http", server: str = SERVER) -> dict[str, str]:
    """The pod's scrape target: what carries its `llmserver` label."""
    return series("up", "1+0x20", pod=pod, server=server, endpoint=port, job=server)


def near_limit(percent: str, pod: str = POD) -> dict[str, Any]:
    return fired(
        "critical",
        "Engine container memory near its limit",
        f"The engine container's memory working set is {percent} of its memory limit "
        "(threshold 0.9) for 2m; at the limit the kernel kills it (OOMKilled).",
        "pagekeeperhostmemorynearlimit",
        pod=pod,
    )


HOST_MEMORY_CASES = [
    # 60 of 64 GiB (93.75%) from 3m: pending for 2m, then firing, for this pod only.
    case(
        "PagekeeperHostMemoryNearLimit",
        [
            cadvisor(f"{40 * GIB}+0x2 {60 * GIB}+0x15"),
            limit(f"{LIMIT}+0x20"),
            target(),
            cadvisor(f"{40 * GIB}+0x20", pod=OTHER_POD),
            limit(f"{LIMIT}+0x20", pod=OTHER_POD),
            target(pod=OTHER_POD),
        ],
        {"3m": [], "4m": [], "5m": [near_limit("93.75%")], "10m": [near_limit("93.75%")]},
    ),
    # Two scrape targets of one pod (vLLM's and the launcher's ports) give one alert.
    case(
        "PagekeeperHostMemoryNearLimit",
        [
            cadvisor(f"{60 * GIB}+0x10"),
            limit(f"{LIMIT}+0x10"),
            target(),
            target(port="pk-metrics"),
        ],
        {"5m": [near_limit("93.75%")]},
    ),
    # Exactly the threshold (9 of 10 GiB) is not above it.
    case(
        "PagekeeperHostMemoryNearLimit",
        [cadvisor(f"{9 * GIB}+0x10"), limit(f"{10 * GIB}+0x10"), target()],
        {"10m": []},
    ),
    # A 1-minute spike (a checkpoint's page cache at start-up) is shorter than `for`.
    case(
        "PagekeeperHostMemoryNearLimit",
        [
            cadvisor(f"{40 * GIB}+0x2 {63 * GIB}+0x1 {40 * GIB}+0x10"),
            limit(f"{LIMIT}+0x15"),
            target(),
        ],
        {"3m": [], "4m": [], "6m": []},
    ),
    # Other containers of the pod, the pod's own cgroup (container="") and its CPU limit are
    # not the engine's memory; a container with no memory limit never fires.
    case(
        "PagekeeperHostMemoryNearLimit",
        [
            cadvisor(f"{60 * GIB}+0x10", container="sidecar"),
            cadvisor(f"{60 * GIB}+0x10", container=""),
            cadvisor(f"{40 * GIB}+0x10"),
            limit(f"{LIMIT}+0x10"),
            limit("8+0x10", resource="cpu"),
            target(),
            cadvisor(f"{60 * GIB}+0x10", pod=OTHER_POD),
            target(pod=OTHER_POD),
        ],
        {"10m": []},
    ),
    # A pod scraped for another LLMServer is not this server's.
    case(
        "PagekeeperHostMemoryNearLimit",
        [cadvisor(f"{60 * GIB}+0x10"), limit(f"{LIMIT}+0x10"), target(server="unmanaged")],
        {"10m": []},
    ),
]


def over_capacity(used: str) -> dict[str, Any]:
    return fired(
        "critical",
        "Host KV tier above its capacity",
        f"The host KV tier holds {used}B, more than its capacity, for 1m: the tier's bound, "
        "which the pod's memory limit counts on, does not hold.",
        "pagekeeperkvoffloadovercapacity",
    )


def tier(used: str, capacity: str) -> list[dict[str, str]]:
    return [
        series("pagekeeper_kv_offload_bytes_used", used, model_name="m"),
        series("pagekeeper_kv_offload_bytes_capacity", capacity, model_name="m"),
    ]


KV_OFFLOAD_CASES = [
    # A full tier is its steady state: no alert at capacity, however long.
    case(
        "PagekeeperKVOffloadOverCapacity",
        tier(f"0+{4 * GIB}x8 {32 * GIB}+0x20", f"{32 * GIB}+0x28"),
        {"10m": [], "28m": []},
    ),
    # One byte past it, held for `for` (1m): firing.
    case(
        "PagekeeperKVOffloadOverCapacity",
        tier(f"{32 * GIB}+0x2 {32 * GIB + 1}+0x10", f"{32 * GIB}+0x12"),
        {"3m": [], "4m": [over_capacity("32Gi")], "10m": [over_capacity("32Gi")]},
    ),
    # No tier: nothing used, nothing to hold.
    case("PagekeeperKVOffloadOverCapacity", tier("0+0x10", "0+0x10"), {"10m": []}),
]


def write_rules(tmp_path: Path) -> list[str]:
    (tmp_path / "chat.rules.yml").write_text(
        render_rules_file(SERVER, NS, RemediationSpec(), "pagekeeper")
    )
    return ["chat.rules.yml"]


def test_host_memory_alerts_under_promtool(tmp_path: Path) -> None:
    tests = {
        "rule_files": write_rules(tmp_path),
        "evaluation_interval": "1m",
        "tests": HOST_MEMORY_CASES + KV_OFFLOAD_CASES,
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run([promtool(), "test", "rules", "tests.yml"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
