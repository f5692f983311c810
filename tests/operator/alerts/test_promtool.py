"""The rendered alerts under promtool: each fires when it should, and stays silent when idle,
at exactly its threshold, and on a spike shorter than its duration."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.tools import tool
from pagekeeper_operator.alerts.render import render_rules_file
from pagekeeper_operator.api.remediation import RemediationSpec

NS = "llm-prod"
SERVER = "chat"
POD = "chat-6d8f7c9b5-x2x4q"
# A second server with its own thresholds, to show the spec's values reach the rules.
CUSTOM_SERVER = "batch"
CUSTOM_POD = "batch-5f6c8d7b9-k7m2p"
CUSTOM_SPEC = RemediationSpec.model_validate(
    {"triggers": {"kvCacheSaturation": {"threshold": 0.8, "for": "1m"}}}
)
GIB = 1 << 30


def series(
    metric: str, values: str, pod: str = POD, server: str = SERVER, **extra: str
) -> dict[str, str]:
    labels = {"namespace": NS, "pod": pod, "llmserver": server, **extra}
    text = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{metric}{{{text}}}", "values": values}


def fired(
    severity: str,
    summary: str,
    description: str,
    anchor: str,
    pod: str = POD,
    server: str = SERVER,
) -> dict[str, Any]:
    return {
        "exp_labels": {
            "severity": severity,
            "pagekeeper_remediate": "true",
            "namespace": NS,
            "pod": pod,
            "llmserver": server,
        },
        "exp_annotations": {
            "summary": f"{summary} on {NS}/{pod}",
            "description": description,
            "runbook_url": f"docs/runbook.md#{anchor}",
        },
    }


def case(
    alert: str, input_series: list[dict[str, str]], expectations: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """One promtool test: `expectations` maps an eval time to the alerts firing then."""
    return {
        "interval": "1m",
        "input_series": input_series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": alerts}
            for at, alerts in expectations.items()
        ],
    }


def fragmentation(ratio: str) -> dict[str, Any]:
    return fired(
        "warning",
        "GPU allocator fragmentation high",
        f"{ratio} of the memory the caching allocator reserved is unused "
        f"(threshold 0.25, at least 1Gi) for 10m.",
        "pagekeeperfragmentationhigh",
    )


def frag_series(reserved: str, allocated: str, server: str = SERVER) -> list[dict[str, str]]:
    return [
        series("pagekeeper_allocator_reserved_bytes", reserved, server=server, device="0"),
        series("pagekeeper_allocator_allocated_bytes", allocated, server=server, device="0"),
    ]


FRAG_CASES = [
    # 8 GiB reserved, 4 GiB used: pending until `for` (10m) has passed, then firing.
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{8 * GIB}+0x15", f"{4 * GIB}+0x15"),
        {"9m": [], "10m": [fragmentation("50%")], "15m": [fragmentation("50%")]},
    ),
    # Idle: everything reserved is in use, or nothing reserved at all (0/0 is not a ratio).
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{8 * GIB}+0x15", f"{8 * GIB}+0x15"),
        {"15m": []},
    ),
    case("PagekeeperFragmentationHigh", frag_series("0+0x15", "0+0x15"), {"15m": []}),
    # Exactly the ratio threshold: 2 of 8 GiB unused is 0.25, not above it.
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{8 * GIB}+0x15", f"{6 * GIB}+0x15"),
        {"15m": []},
    ),
    # A high ratio on a small pool: exactly minBytes (1 GiB) unused is not above it.
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{2 * GIB}+0x15", f"{1 * GIB}+0x15"),
        {"15m": []},
    ),
    # A 5-minute spike, shorter than `for`.
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{8 * GIB}+0x15", f"{4 * GIB}+0x4 {8 * GIB}+0x10"),
        {"5m": [], "12m": []},
    ),
    # A pod of a server these rules do not cover (another llmserver label) is not selected.
    case(
        "PagekeeperFragmentationHigh",
        frag_series(f"{8 * GIB}+0x15", f"{4 * GIB}+0x15", server="unmanaged"),
        {"15m": []},
    ),
]


def kv(
    percent: str, pod: str = POD, server: str = SERVER, threshold: str = "0.95", for_: str = "2m"
) -> dict[str, Any]:
    return fired(
        "warning",
        "KV cache nearly full",
        f"KV cache usage is {percent} (threshold {threshold}) for {for_}.",
        "pagekeeperkvcachesaturated",
        pod=pod,
        server=server,
    )


def kv_series(values: str, pod: str = POD, server: str = SERVER) -> list[dict[str, str]]:
    return [series("vllm:kv_cache_usage_perc", values, pod=pod, server=server, model_name="m")]


KV_CASES = [
    case(
        "PagekeeperKVCacheSaturated",
        kv_series("0.97+0x10"),
        {"1m": [], "2m": [kv("97%")], "10m": [kv("97%")]},
    ),
    case("PagekeeperKVCacheSaturated", kv_series("0+0x10"), {"10m": []}),
    case("PagekeeperKVCacheSaturated", kv_series("0.95+0x10"), {"10m": []}),
    # Two samples (5m, 6m) above the threshold: shorter than `for`.
    case(
        "PagekeeperKVCacheSaturated",
        kv_series("0.5+0x4 0.99+0x1 0.5+0x5"),
        {"6m": [], "7m": [], "10m": []},
    ),
    # The custom server's threshold (0.8 for 1m) fires at 0.85; the default server's does not.
    case(
        "PagekeeperKVCacheSaturated",
        kv_series("0.85+0x5") + kv_series("0.85+0x5", pod=CUSTOM_POD, server=CUSTOM_SERVER),
        {
            "1m": [kv("85%", pod=CUSTOM_POD, server=CUSTOM_SERVER, threshold="0.8", for_="1m")],
            "5m": [kv("85%", pod=CUSTOM_POD, server=CUSTOM_SERVER, threshold="0.8", for_="1m")],
        },
    ),
]


def backlog(waiting: str) -> dict[str, Any]:
    return fired(
        "warning",
        "Request queue backlog",
        f"{waiting} requests are waiting, more than 3.0 times those running, for 5m.",
        "pagekeeperqueuebacklog",
    )


def queue(waiting: str, running: str) -> list[dict[str, str]]:
    return [
        series("vllm:num_requests_waiting", waiting, model_name="m"),
        series("vllm:num_requests_running", running, model_name="m"),
    ]


BACKLOG_CASES = [
    case("PagekeeperQueueBacklog", queue("10+0x10", "2+0x10"), {"4m": [], "5m": [backlog("10")]}),
    # Nothing running at all while requests wait is a backlog too.
    case("PagekeeperQueueBacklog", queue("1+0x10", "0+0x10"), {"5m": [backlog("1")]}),
    case("PagekeeperQueueBacklog", queue("0+0x10", "0+0x10"), {"10m": []}),
    # Exactly 3 x running.
    case("PagekeeperQueueBacklog", queue("6+0x10", "2+0x10"), {"10m": []}),
    # A 3-minute burst, shorter than `for`.
    case("PagekeeperQueueBacklog", queue("10+0x2 0+0x8", "2+0x10"), {"5m": [], "10m": []}),
]


def stalled(waiting: str) -> dict[str, Any]:
    return fired(
        "critical",
        "Engine stalled",
        f"At least {waiting} requests have been waiting and none has succeeded for 5m.",
        "pagekeeperenginestalled",
    )


def engine(waiting: str, successes: str | None) -> list[dict[str, str]]:
    result = [series("vllm:num_requests_waiting", waiting, model_name="m")]
    if successes is not None:
        result.append(
            series("vllm:request_success_total", successes, model_name="m", finished_reason="stop")
        )
    return result


STALLED_CASES = [
    # Waiting throughout with a flat success counter. Boundaries stay off the window's edge,
    # whose inclusion differs between Prometheus releases.
    case(
        "PagekeeperEngineStalled",
        engine("3+0x12", "40+0x12"),
        {"3m": [], "6m": [stalled("3")], "12m": [stalled("3")]},
    ),
    # An engine that never completed a request has no success series at all.
    case("PagekeeperEngineStalled", engine("2+0x10", None), {"6m": [stalled("2")]}),
    # Idle: nothing waiting, nothing succeeding.
    case("PagekeeperEngineStalled", engine("0+0x10", "40+0x10"), {"10m": []}),
    # Busy: requests wait but one succeeds every minute.
    case("PagekeeperEngineStalled", engine("5+0x15", "0+1x15"), {"10m": [], "15m": []}),
    # The last success at 5m: still inside the window at 8m; 5m of nothing by 11m.
    case(
        "PagekeeperEngineStalled",
        engine("3+0x15", "0+0x4 1+0x10"),
        {"8m": [], "11m": [stalled("3")]},
    ),
    # A 4-minute stall that clears.
    case(
        "PagekeeperEngineStalled", engine("3+0x3 0+0x10", "7+0x13"), {"4m": [], "6m": [], "10m": []}
    ),
    # A new pod (first scraped at 6m) with its first request waiting is not a stalled window.
    case("PagekeeperEngineStalled", engine("_x6 3+0x6", None), {"8m": [], "11m": [stalled("3")]}),
]


def oom(increase: str) -> dict[str, Any]:
    return fired(
        "critical",
        "Out-of-memory events",
        f"pagekeeper_oom_events_total rose by {increase} in the last 5m.",
        "pagekeeperoomevents",
    )


OOM_CASES = [
    # Any increase fires at once (a single event is not a spike to ignore), and clears once
    # the 5m window has passed it.
    case(
        "PagekeeperOOMEvents",
        [series("pagekeeper_oom_events_total", "0+0x3 1+0x10", kind="gpu_step")],
        {"3m": [], "4m": [oom("1")], "6m": [oom("1")], "10m": []},
    ),
    case(
        "PagekeeperOOMEvents",
        [series("pagekeeper_oom_events_total", "0+0x10", kind="gpu_step")],
        {"10m": []},
    ),
    # Events of every kind add up into one alert for the pod.
    case(
        "PagekeeperOOMEvents",
        [
            series("pagekeeper_oom_events_total", "0+0x3 1+0x10", kind="gpu_step"),
            series("pagekeeper_oom_events_total", "0+0x3 1+0x10", kind="host"),
        ],
        {"6m": [oom("2")]},
    ),
]


def promtool() -> str:
    return tool("promtool")


def write_rules(tmp_path: Path) -> list[str]:
    (tmp_path / "chat.rules.yml").write_text(
        render_rules_file(SERVER, NS, RemediationSpec(), "pagekeeper")
    )
    (tmp_path / "batch.rules.yml").write_text(
        render_rules_file(CUSTOM_SERVER, NS, CUSTOM_SPEC, "pagekeeper")
    )
    return ["chat.rules.yml", "batch.rules.yml"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_rendered_rules_pass_promtool_check(tmp_path: Path) -> None:
    binary = promtool()
    result = run([binary, "check", "rules", *write_rules(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS: 7 rules found") == 2


@pytest.mark.parametrize(
    "cases",
    [FRAG_CASES, KV_CASES, BACKLOG_CASES, STALLED_CASES, OOM_CASES],
    ids=["fragmentation", "kv-cache", "backlog", "stalled", "oom"],
)
def test_alert_behaviour_under_promtool(tmp_path: Path, cases: list[dict[str, Any]]) -> None:
    binary = promtool()
    tests = {"rule_files": write_rules(tmp_path), "evaluation_interval": "1m", "tests": cases}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run([binary, "test", "rules", "tests.yml"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
