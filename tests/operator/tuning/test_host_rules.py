"""The host KV tier's rules on fixture windows: on, up and down with exact sizes, the windows
where they stay silent, and a tier the memory plan cannot hold dropped with the plan's reason."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import TuningSpec
from pagekeeper_operator.policy.fields import with_change, within_bounds
from pagekeeper_operator.policy.fit import decide_fit
from pagekeeper_operator.tuning.host_rules import size_text
from pagekeeper_operator.tuning.proposal import Proposal
from pagekeeper_operator.tuning.rules import recommend
from pagekeeper_operator.tuning.tuner import Observation, tune
from pagekeeper_operator.tuning.window import MetricWindow
from tests.operator.servers import make_server
from tests.operator.tuning.test_rules import changes, window

T0 = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
TIER_16 = {"kvOffload": {"size": "16Gi"}}
TIER_32 = {"kvOffload": {"size": "32Gi"}}


def run(
    seen: MetricWindow,
    policy: dict[str, Any] | None = None,
    bounds: dict[str, Any] | None = None,
    *,
    runtime: str = "pagekeeper",
    is_memory_limit_fixed: bool = False,
) -> list[Proposal]:
    return recommend(
        seen,
        MemoryPolicy.model_validate(policy or {}),
        TuningSpec.model_validate({"bounds": bounds or {}}),
        "vllm" if runtime == "vllm" else "pagekeeper",
        is_memory_limit_fixed=is_memory_limit_fixed,
    )


def test_evicted_prefixes_turn_the_tier_on_at_the_gpu_caches_size() -> None:
    [proposal] = run(window("agent_evicted_prefixes"))
    assert changes([proposal]) == [("kvOffload.size", "", "41Gi", "kv-offload-on")]
    assert proposal.evidence == (
        ("evictedMissShare", 0.15),
        ("prefixQueryTokens", 720000.0),
        ("gpuKvCacheGiB", 40.25),
    )
    assert proposal.confidence == 0.75  # all the samples it wants, at 0.15 / 0.2 of its share
    policy = with_change(MemoryPolicy(), proposal.field, proposal.proposed)
    assert policy.kv_offload is not None
    assert (policy.kv_offload.size, policy.kv_offload.backend) == ("41Gi", "native")


def test_the_first_size_keeps_to_the_bounds() -> None:
    seen = window("agent_evicted_prefixes")
    capped = run(seen, bounds={"kvOffloadSize": {"min": "8Gi", "max": "32Gi"}})
    assert changes(capped) == [("kvOffload.size", "", "32Gi", "kv-offload-on")]
    raised = run(seen, bounds={"kvOffloadSize": {"min": "48Gi", "max": "64Gi"}})
    assert changes(raised) == [("kvOffload.size", "", "48Gi", "kv-offload-on")]
    # Without the GPU budget's series (a CPU engine) the bound's min, and unbounded nothing.
    no_budget = replace(seen, kv_cache_bytes=None)
    bounded = run(no_budget, bounds={"kvOffloadSize": {"min": "1536Mi", "max": "8Gi"}})
    assert changes(bounded) == [("kvOffload.size", "", "1536Mi", "kv-offload-on")]
    assert run(no_budget) == []


def test_a_tier_still_evicting_doubles_within_the_bounds_max() -> None:
    seen = window("agent_evicted_prefixes")
    [proposal] = run(seen, TIER_16)
    assert changes([proposal]) == [("kvOffload.size", "16Gi", "32Gi", "kv-offload-up")]
    assert dict(proposal.evidence)["kvOffloadGiB"] == 16.0
    bounds = {"kvOffloadSize": {"min": "8Gi", "max": "24Gi"}}
    assert changes(run(seen, TIER_16, bounds)) == [
        ("kvOffload.size", "16Gi", "24Gi", "kv-offload-up")
    ]
    at_max = {"kvOffload": {"size": "24Gi"}}
    assert run(seen, at_max, bounds) == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"prefix_evicted_misses": 71999.0}, "under a tenth of looked-up tokens"),
        ({"prefix_evicted_misses": None}, "the runtime does not count them"),
        ({"prefix_queries": 49_999.0, "prefix_evicted_misses": 20_000.0}, "thin evidence"),
        ({"num_oom_terminations": 1}, "an OOM in the window"),
        ({"is_stepped_down": True}, "a step-down caps the policy"),
        ({"host_memory_ratio_peak": 0.9}, "host memory at the alert's threshold"),
    ],
)
def test_no_growth_without_the_evidence_or_near_trouble(change: dict[str, Any], why: str) -> None:
    seen = replace(window("agent_evicted_prefixes"), **change)
    assert run(seen) == [], why
    assert run(seen, TIER_16) == [], why


def test_no_tier_without_prefix_caching_or_under_vllm() -> None:
    seen = window("agent_evicted_prefixes")
    assert run(seen, {"enablePrefixCaching": False}) == []
    assert run(seen, runtime="vllm") == []
    assert not within_bounds("kvOffload.size", "16Gi", TuningSpec().bounds, "vllm")


def test_host_memory_near_a_fixed_limit_shrinks_the_tier_first() -> None:
    seen = window("host_memory_near_limit")
    [proposal] = run(seen, TIER_32, is_memory_limit_fixed=True)
    # 95% of 48Gi, brought to 80% (HOST_MARGIN under the 0.9 threshold): 7.2 GiB less, whole
    # GiB down; the evicted misses would grow the tier, but not near the limit.
    assert changes([proposal]) == [("kvOffload.size", "32Gi", "24Gi", "kv-offload-down")]
    assert proposal.evidence == (
        ("workingSetPeakRatio", 0.95),
        ("memoryLimitGiB", 48.0),
        ("threshold", 0.9),
        ("kvOffloadGiB", 32.0),
    )
    assert proposal.confidence == 0.75
    assert proposal.expected_effect.startswith(
        "the engine container's working set reached 95% of its memory limit: 8 GiB less"
    )
    floored = run(
        seen, TIER_32, {"kvOffloadSize": {"min": "28Gi", "max": "64Gi"}},
        is_memory_limit_fixed=True,
    )  # fmt: skip
    assert changes(floored) == [("kvOffload.size", "32Gi", "28Gi", "kv-offload-down")]
    small = {"kvOffload": {"size": "4Gi"}}
    assert changes(run(seen, small, is_memory_limit_fixed=True)) == [
        ("kvOffload.size", "4Gi", "1Gi", "kv-offload-down")
    ]


def test_the_shrink_comes_before_every_other_rule() -> None:
    seen = replace(window("host_memory_near_limit"), num_fragmentation_alerts=3)
    proposals = run(seen, {**TIER_32, "allocator": {"expandableSegments": False}},
                    is_memory_limit_fixed=True)  # fmt: skip
    assert [p.rule for p in proposals] == ["kv-offload-down", "allocator-expandable"]


def test_a_limit_the_plan_sets_is_not_helped_by_a_smaller_tier() -> None:
    # The planned limit holds the tier: shrinking it lowers the limit as much.
    assert run(window("host_memory_near_limit"), TIER_32) == []
    # Under the threshold nothing shrinks, and without a limit there is nothing to be near.
    below = replace(window("host_memory_near_limit"), host_memory_ratio_peak=0.89)
    assert changes(run(below, TIER_32, is_memory_limit_fixed=True)) == [
        ("kvOffload.size", "32Gi", "64Gi", "kv-offload-up")
    ]
    no_limit = replace(window("host_memory_near_limit"), memory_limit_bytes=None)
    assert run(no_limit, TIER_32, is_memory_limit_fixed=True) == []


def test_the_alerts_threshold_is_the_servers() -> None:
    seen = replace(window("host_memory_near_limit"), host_memory_ratio_peak=0.86)
    [proposal] = recommend(
        seen, MemoryPolicy.model_validate(TIER_32), TuningSpec(), "pagekeeper",
        host_memory_threshold=0.85, is_memory_limit_fixed=True,
    )  # fmt: skip
    # 86% of 48Gi brought to 75%: 5.28 GiB less, whole GiB down.
    assert (proposal.rule, proposal.proposed) == ("kv-offload-down", "26Gi")


def test_sizes_are_written_in_their_shortest_exact_unit() -> None:
    assert [size_text(n) for n in (41 << 30, 1536 << 20, 1536 << 20 | 1)] == [
        "41Gi",
        "1536Mi",
        str(1536 << 20 | 1),
    ]


# A node whose allocatable memory holds a 41Gi tier beside the pod's other terms, not 48Gi.
NODE = {
    "metadata": {"name": "gpu-a", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
    "status": {"allocatable": {"memory": "48Gi"}},
}


def _does_not_fit(server: LLMServer, policy: MemoryPolicy) -> str | None:
    """The reconcile's gate (`reconcile._with_tuning`): the memory plan on the candidate."""
    fit = decide_fit(server, policy, [NODE])
    return fit.status.message if fit.holds_rollout else None


def test_a_tier_the_node_cannot_hold_is_dropped_with_the_plans_reason() -> None:
    seen = window("agent_evicted_prefixes")
    fitting = tune(make_server(), Observation(seen), T0, _does_not_fit)
    assert [(r.field, r.proposed, r.rule) for r in fitting.recommendations] == [
        ("kvOffload.size", "41Gi", "kv-offload-on")
    ]
    assert fitting.tuning is not None and fitting.tuning.dropped == []
    larger = replace(seen, kv_cache_bytes=float(44 << 30))
    dropped = tune(make_server(), Observation(larger), T0, _does_not_fit)
    assert dropped.recommendations == []
    assert dropped.tuning is not None
    [gone] = dropped.tuning.dropped
    assert (gone.field, gone.proposed, gone.rule) == ("kvOffload.size", "44Gi", "kv-offload-on")
    assert "kvOffload 44.00 GiB" in gone.reason and "gpu-a" in gone.reason
    [event] = dropped.events
    assert (event.reason, event.message[:63]) == (
        "TuningRecommendationDropped",
        "kvOffload.size unset -> 44Gi (kv-offload-on) is not recommended",
    )
