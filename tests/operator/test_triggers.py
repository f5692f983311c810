"""Which alert triggers are active for a server, and the status that says so."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.alerts.triggers import trigger_status
from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import TRIGGERS, missing_series


def _status(runtime: Any, spec: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    remediation = RemediationSpec.model_validate(spec or {})
    return [entry.to_api() for entry in trigger_status(runtime, remediation)]


def test_pagekeeper_runtime_feeds_every_trigger() -> None:
    assert all(not missing_series("pagekeeper", t) for t in TRIGGERS)
    assert _status("pagekeeper") == [
        {
            "name": t.key,
            "alert": t.alert,
            "active": True,
            "reason": "Active",
            "message": f"reads {', '.join(t.series)}",
        }
        for t in TRIGGERS
    ]


def test_vllm_with_the_plugin_feeds_every_trigger_but_the_host_tiers() -> None:
    assert [t.key for t in TRIGGERS if missing_series("vllm", t)] == ["kvOffloadOverCapacity"]
    pagekeeper, vllm = _status("pagekeeper"), _status("vllm")
    assert vllm[:-1] == pagekeeper[:-1]
    assert vllm[-1] == {
        "name": "kvOffloadOverCapacity",
        "alert": "PagekeeperKVOffloadOverCapacity",
        "active": False,
        "reason": "SeriesNotExported",
        "message": "runtime vllm does not export pagekeeper_kv_offload_bytes_used, "
        "pagekeeper_kv_offload_bytes_capacity",
    }


def test_the_host_memory_trigger_reads_the_clusters_series_under_both_runtimes() -> None:
    for runtime in ("pagekeeper", "vllm"):
        for has_plugin in (True, False):
            [host] = [
                entry.to_api()
                for entry in trigger_status(runtime, RemediationSpec(), has_plugin=has_plugin)
                if entry.name == "hostMemory"
            ]
            assert host == {
                "name": "hostMemory",
                "alert": "PagekeeperHostMemoryNearLimit",
                "active": True,
                "reason": "Active",
                "message": "reads container_memory_working_set_bytes, "
                "kube_pod_container_resource_limits, up",
            }


def test_vllm_plugins_without_pagekeeper_leaves_the_allocator_triggers_unfed() -> None:
    remediation = RemediationSpec()
    status = {
        entry.name: entry.to_api()
        for entry in trigger_status("vllm", remediation, has_plugin=False)
    }
    assert {name for name, entry in status.items() if entry["active"]} == {
        "kvCacheSaturation",
        "queueBacklog",
        "engineStalled",
        "hostMemory",
    }
    assert status["fragmentation"] == {
        "name": "fragmentation",
        "alert": "PagekeeperFragmentationHigh",
        "active": False,
        "reason": "SeriesNotExported",
        "message": "runtime vllm does not export pagekeeper_allocator_reserved_bytes, "
        "pagekeeper_allocator_allocated_bytes: VLLM_PLUGINS leaves out pagekeeper's plugin "
        "(pagekeeper)",
    }
    assert status["oomEvents"]["message"] == (
        "runtime vllm does not export pagekeeper_oom_events_total: VLLM_PLUGINS leaves out "
        "pagekeeper's plugin (pagekeeper)"
    )
    # The runtime decides first: off in spec and unfed reads as unfed.
    off = RemediationSpec.model_validate({"triggers": {"fragmentation": {"enabled": False}}})
    assert trigger_status("vllm", off, has_plugin=False)[0].reason == "SeriesNotExported"


def test_a_trigger_switched_off_says_so() -> None:
    status = _status("vllm", {"triggers": {"queueBacklog": {"enabled": False}}})
    backlog = next(entry for entry in status if entry["name"] == "queueBacklog")
    assert (backlog["active"], backlog["reason"], backlog["message"]) == (
        False,
        "DisabledInSpec",
        "spec.remediation.triggers.queueBacklog.enabled is false",
    )


def test_enabled_true_cannot_feed_an_alert_the_runtime_lacks() -> None:
    # VLLM_PLUGINS may leave the plugin out of a server whose spec asks for the OOM alert.
    remediation = RemediationSpec.model_validate({"triggers": {"oomEvents": {"enabled": True}}})
    status = trigger_status("vllm", remediation, has_plugin=False)
    [oom] = [entry for entry in status if entry.name == "oomEvents"]
    assert oom.active is False and oom.reason == "SeriesNotExported"
