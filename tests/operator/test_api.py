"""The LLMServer models: defaults, camelCase on the wire, and the cross-field rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pagekeeper_operator.api.autoscaling import MIN_MAX_RULE, TARGET_RULE
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.pod import ENV_RULE
from pagekeeper_operator.api.policy import (
    BATCHED_TOKENS_RULE,
    KV_OFFLOAD_BACKEND_RULE,
    KV_OFFLOAD_PREFIX_RULE,
    KV_OFFLOAD_SIZE_RULE,
    NUM_SEQS_RULE,
    SPLIT_SIZE_RULE,
    KVOffloadPolicy,
)
from pagekeeper_operator.api.rollout import ROLLOUT_RULE
from pagekeeper_operator.api.spec_rules import (
    ADAPTIVE_FLOOR_RULE,
    AUTOSCALING_CANARY_RULE,
    BLOCK_SIZE_RULE,
    CANARY_CAPACITY_RULE,
    CANARY_RULE,
    DRAIN_RULE,
    GPU_RULE,
    PYTHONPATH_RULE,
    SWAP_RULE,
    TRIGGER_RULES,
)
from pagekeeper_operator.api.tuning import APPLY_RULE, BOUNDS_RULES, ITL_RULE, TTFT_RULE
from pagekeeper_operator.api.tuning_bounds import TIER_MIN_RULE, TIER_ORDER_RULE, TIER_RANGE_RULE
from tests.operator.servers import make_server, server_body


def test_defaults_of_a_minimal_server() -> None:
    spec = make_server().spec
    assert spec.runtime == "pagekeeper"
    assert spec.replicas == 1
    assert (spec.resources.gpus, spec.parallelism.tensor, spec.num_gpus) == (None, 1, 1)
    assert spec.shutdown_grace_period_seconds == 30
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (0, 1)
    # No utilization in the spec: 0.9 applies unless kvCacheMemory replaces it.
    assert spec.memory_policy.effective_utilization == 0.9
    assert spec.memory_policy.to_api() == {
        "blockSize": 16,
        "maxNumBatchedTokens": 8192,
        "maxNumSeqs": 256,
        "swapSpaceGiB": 0.0,
        "enableChunkedPrefill": True,
        "enablePrefixCaching": True,
        "prefixCacheMaxFraction": 0.5,
        "fragmentationBuffer": "auto",
        "kvCacheDtype": "auto",
        "allocator": {"expandableSegments": True},
    }


def test_snake_case_names_are_accepted_and_camel_case_is_written() -> None:
    server = make_server({"memoryPolicy": {"maxModelLen": 4096, "swapSpaceGiB": 2}})
    assert server.spec.memory_policy.max_model_len == 4096
    assert server.spec.memory_policy.swap_space_gib == 2.0
    assert server.spec.memory_policy.to_api()["swapSpaceGiB"] == 2.0


def test_integer_quantities_become_text() -> None:
    spec = make_server({"resources": {"requests": {"cpu": 4, "memory": "16Gi"}}}).spec
    assert spec.resources.requests.to_api() == {"cpu": "4", "memory": "16Gi"}


def _error_messages(spec: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        make_server(spec)
    return str(info.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"memoryPolicy": {"enableChunkedPrefill": False, "maxModelLen": 9000}},
            BATCHED_TOKENS_RULE["message"],
        ),
        (
            {"memoryPolicy": {"maxNumSeqs": 300, "maxNumBatchedTokens": 256}},
            NUM_SEQS_RULE["message"],
        ),
        ({"runtime": "vllm", "memoryPolicy": {"swapSpaceGiB": 4}}, SWAP_RULE["message"]),
        ({"memoryPolicy": {"allocator": {"maxSplitSizeMb": 512}}}, SPLIT_SIZE_RULE["message"]),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, ROLLOUT_RULE["message"]),
        (
            {"podTemplate": {"env": [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "x"}]}},
            ENV_RULE["message"],
        ),
        ({"runtime": "vllm", "memoryPolicy": {"blockSize": 8}}, BLOCK_SIZE_RULE["message"]),
        (
            {"memoryPolicy": {"gpuMemoryUtilization": 0.6}},
            ADAPTIVE_FLOOR_RULE["message"],
        ),
        ({"shutdownGracePeriodSeconds": 20}, DRAIN_RULE["message"]),
        ({"parallelism": {"tensor": 4}, "resources": {"gpus": 2}}, GPU_RULE["message"]),
        ({"parallelism": {"tensor": 2}, "resources": {"gpus": 0}}, GPU_RULE["message"]),
        (
            {
                "runtime": "vllm",
                "podTemplate": {
                    "env": [{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {}}}]
                },
            },
            PYTHONPATH_RULE["message"],
        ),
        ({"autoscaling": {"minReplicas": 4, "maxReplicas": 3}}, MIN_MAX_RULE["message"]),
        (
            {
                "autoscaling": {
                    "maxReplicas": 3,
                    "targets": {"kvCacheUsage": 0, "waitingRequests": 0},
                }
            },
            TARGET_RULE["message"],
        ),
        (
            {"replicas": 1, "rollout": {"canary": {"enabled": True}}},
            CANARY_RULE["message"],
        ),
        (
            {
                "replicas": 5,
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
                "rollout": {"canary": {"enabled": True}},
            },
            AUTOSCALING_CANARY_RULE["message"],
        ),
        ({"tuning": {"objective": "ThroughputUnderTTFT"}}, TTFT_RULE["message"]),
        ({"tuning": {"objective": "ThroughputUnderITL"}}, ITL_RULE["message"]),
        (
            {"tuning": {"bounds": {"maxNumSeqs": {"min": 64, "max": 32}}}},
            BOUNDS_RULES[1]["message"],
        ),
        (
            {"tuning": {"bounds": {"gpuMemoryUtilization": {"min": 0.5, "max": 0.8}}}},
            BOUNDS_RULES[3]["message"],
        ),
        (
            {
                "memoryPolicy": {"maxNumBatchedTokens": 4096},
                "tuning": {"bounds": {"maxNumBatchedTokens": {"min": 8192, "max": 16384}}},
            },
            BOUNDS_RULES[5]["message"],
        ),
        ({"tuning": {"bounds": {"blockSizes": [8, 32]}}}, BOUNDS_RULES[6]["message"]),
        (
            {"replicas": 4, "rollout": {"canary": {"enabled": True, "replicas": 2}}},
            CANARY_CAPACITY_RULE["message"],
        ),
        ({"replicas": 2, "tuning": {"mode": "Apply"}}, APPLY_RULE["message"]),
        ({"memoryPolicy": {"kvOffload": {"size": "0"}}}, KV_OFFLOAD_SIZE_RULE["message"]),
        ({"memoryPolicy": {"kvOffload": {"size": "0Gi"}}}, KV_OFFLOAD_SIZE_RULE["message"]),
        (
            {"memoryPolicy": {"enablePrefixCaching": False, "kvOffload": {"size": "8Gi"}}},
            KV_OFFLOAD_PREFIX_RULE["message"],
        ),
        (
            {"memoryPolicy": {"kvOffload": {"size": "8Gi", "backend": "lmcache"}}},
            KV_OFFLOAD_BACKEND_RULE["message"],
        ),
        (
            {"tuning": {"bounds": {"kvOffloadSize": {"min": "0", "max": "8Gi"}}}},
            TIER_MIN_RULE["message"],
        ),
        (
            {"tuning": {"bounds": {"kvOffloadSize": {"min": "16Gi", "max": "8Gi"}}}},
            TIER_ORDER_RULE["message"],
        ),
        (
            {
                "memoryPolicy": {"kvOffload": {"size": "4Gi"}},
                "tuning": {"bounds": {"kvOffloadSize": {"min": "8Gi", "max": "64Gi"}}},
            },
            TIER_RANGE_RULE["message"],
        ),
    ],
)
def test_cross_field_rules_refuse_with_the_crd_message(spec: dict[str, Any], message: str) -> None:
    assert message in _error_messages(spec)


def test_a_tier_bound_holding_the_specs_tier_is_kept() -> None:
    tier = {"memoryPolicy": {"kvOffload": {"size": "32Gi"}}}
    for bounds in ({"min": "32Gi", "max": "32Gi"}, {"min": "1536Mi", "max": "64Gi"}):
        server = make_server({**tier, "tuning": {"bounds": {"kvOffloadSize": bounds}}})
        kept = server.spec.tuning.bounds.kv_offload_size
        assert kept is not None and (kept.min, kept.max) == (bounds["min"], bounds["max"])
    untiered = make_server({"tuning": {"bounds": {"kvOffloadSize": {"min": "8Gi", "max": "64Gi"}}}})
    assert untiered.spec.memory_policy.kv_offload is None
    assert BOUNDS_RULES[-3:] == (TIER_MIN_RULE, TIER_ORDER_RULE, TIER_RANGE_RULE)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"memoryPolicy": {"gpuMemoryUtilization": 0.0}}, "spec.memoryPolicy.gpuMemoryUtilization"),
        ({"memoryPolicy": {"gpuMemoryUtilization": 1.0}}, "spec.memoryPolicy.gpuMemoryUtilization"),
        ({"memoryPolicy": {"blockSize": 12}}, "spec.memoryPolicy.blockSize"),
        (
            {"memoryPolicy": {"fragmentationBuffer": "lots"}},
            "spec.memoryPolicy.fragmentationBuffer",
        ),
        (
            {"memoryPolicy": {"allocator": {"garbageCollectionThreshold": 1.0}}},
            "spec.memoryPolicy.allocator.garbageCollectionThreshold",
        ),
        (
            {"memoryPolicy": {"allocator": {"expandableSegments": False, "maxSplitSizeMb": 20}}},
            "spec.memoryPolicy.allocator.maxSplitSizeMb",
        ),
        ({"runtime": "tgi"}, "spec.runtime"),
        ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor"),
        ({"memoryPolicy": {"kvCacheDtype": "int8"}}, "spec.memoryPolicy.kvCacheDtype"),
        ({"resources": {"requests": {"memory": "lots"}}}, "spec.resources.requests.memory"),
        ({"autoscaling": {"minReplicas": 2}}, "spec.autoscaling.maxReplicas"),
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
        (
            {"autoscaling": {"maxReplicas": 2, "targets": {"kvCacheUsage": 1.5}}},
            "spec.autoscaling.targets.kvCacheUsage",
        ),
        ({"tuning": {"windowSeconds": -5}}, "spec.tuning.windowSeconds"),
        ({"tuning": {"mode": "Auto"}}, "spec.tuning.mode"),
        ({"memoryPolicy": {"kvOffload": {"size": "lots"}}}, "spec.memoryPolicy.kvOffload.size"),
        ({"memoryPolicy": {"kvOffload": {"size": "-1Gi"}}}, "spec.memoryPolicy.kvOffload.size"),
        ({"memoryPolicy": {"kvOffload": {}}}, "spec.memoryPolicy.kvOffload.size"),
        (
            {"memoryPolicy": {"kvOffload": {"size": "1Gi", "backend": "disk"}}},
            "spec.memoryPolicy.kvOffload.backend",
        ),
    ],
)
def test_single_field_bounds_name_the_field(spec: dict[str, Any], field: str) -> None:
    assert f"\n{field}\n" in _error_messages(spec)


def test_rules_allow_what_they_should() -> None:
    chunked = make_server({"memoryPolicy": {"maxModelLen": 32768, "maxNumBatchedTokens": 2048}})
    assert chunked.spec.memory_policy.max_model_len == 32768
    swap = make_server({"memoryPolicy": {"swapSpaceGiB": 8}})
    assert swap.spec.memory_policy.swap_space_gib == 8.0
    vllm = make_server({"runtime": "vllm"})
    assert vllm.spec.memory_policy.swap_space_gib == 0.0
    split = make_server(
        {"memoryPolicy": {"allocator": {"expandableSegments": False, "maxSplitSizeMb": 512}}}
    )
    assert split.spec.memory_policy.allocator.max_split_size_mb == 512
    surge = make_server({"rollout": {"maxSurge": 1, "maxUnavailable": 0}})
    assert surge.spec.rollout.max_surge == 1
    small_blocks = make_server({"memoryPolicy": {"blockSize": 8}})
    assert small_blocks.spec.memory_policy.block_size == 8
    low = {"memoryPolicy": {"gpuMemoryUtilization": 0.6}}
    lowered_floor = make_server(
        {**low, "remediation": {"adaptive": {"minGpuMemoryUtilization": 0.5}}}
    )
    assert lowered_floor.spec.remediation.adaptive.min_gpu_memory_utilization == 0.5
    # A floor of a disabled step-down bounds nothing.
    make_server({**low, "remediation": {"adaptive": {"enabled": False}}})
    grace = make_server(
        {"shutdownGracePeriodSeconds": 60, "remediation": {"drainTimeoutSeconds": 60}}
    )
    assert grace.spec.remediation.drain_timeout_seconds == 60
    # pagekeeper's vLLM plugin feeds every trigger under either runtime but the host tier's,
    # and the cluster feeds the host-memory one.
    on = {
        "fragmentation": {"enabled": True},
        "oomEvents": {"enabled": True},
        "hostMemory": {"enabled": True},
    }
    make_server({"remediation": {"triggers": on}})
    make_server({"runtime": "vllm", "remediation": {"triggers": on}})
    tier_alert = {"kvOffloadOverCapacity": {"enabled": True}}
    make_server({"remediation": {"triggers": tier_alert}})
    with pytest.raises(ValueError, match=r"kvOffloadOverCapacity\.enabled must not be true"):
        make_server({"runtime": "vllm", "remediation": {"triggers": tier_alert}})
    # A literal PYTHONPATH under vllm is kept behind the plugin's.
    make_server(
        {"runtime": "vllm", "podTemplate": {"env": [{"name": "PYTHONPATH", "value": "/x"}]}}
    )
    assert [rule["fieldPath"] for rule in TRIGGER_RULES] == [
        ".remediation.triggers.kvOffloadOverCapacity.enabled"
    ]
    # The GPU count follows the tensor-parallel size, given or derived; 0 is the CPU.
    assert make_server({"parallelism": {"tensor": 4}}).spec.num_gpus == 4
    tp = make_server({"parallelism": {"tensor": 4}, "resources": {"gpus": 4}})
    assert tp.spec.num_gpus == 4
    assert make_server({"resources": {"gpus": 0}}).spec.num_gpus == 0
    # Under autoscaling spec.replicas is not used: the canary is bounded by minReplicas.
    canary = {"rollout": {"canary": {"enabled": True}}}
    autoscaled = make_server(
        {**canary, "replicas": 1, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}
    )
    assert autoscaled.spec.is_autoscaled and not make_server().spec.is_autoscaled
    only_running = {"kvCacheUsage": 0, "waitingRequests": 0, "runningRequests": 8}
    make_server({"autoscaling": {"maxReplicas": 1, "targets": only_running}})


def test_kv_offload_is_unset_by_default_and_kept_as_written() -> None:
    assert make_server().spec.memory_policy.kv_offload is None
    policy = make_server({"memoryPolicy": {"kvOffload": {"size": "32Gi"}}}).spec.memory_policy
    assert policy.to_api()["kvOffload"] == {"size": "32Gi", "backend": "native"}
    # An int in YAML is bytes, kept as its text.
    tier = make_server({"memoryPolicy": {"kvOffload": {"size": 2**31}}}).spec.memory_policy
    assert tier.kv_offload is not None and tier.kv_offload.size == "2147483648"
    assert tier.kv_offload.size_bytes == 2**31


def test_kv_offload_and_swap_may_both_be_set_on_the_paged_engine() -> None:
    """Separate host pools: the tier keeps prefixes, swap keeps preempted sequences."""
    both = {"swapSpaceGiB": 4, "kvOffload": {"size": "16Gi"}}
    policy = make_server({"memoryPolicy": both}).spec.memory_policy
    assert (policy.swap_space_gib, policy.kv_offload) == (4.0, KVOffloadPolicy(size="16Gi"))
    # Under vllm the tier may use either backend; swap stays 0 there (SWAP_RULE).
    for backend in ("native", "lmcache"):
        tier = {"kvOffload": {"size": "16Gi", "backend": backend}}
        vllm = make_server({"runtime": "vllm", "memoryPolicy": tier}).spec.memory_policy
        assert vllm.kv_offload is not None and vllm.kv_offload.backend == backend


@pytest.mark.parametrize(
    ("size", "gib"),
    [
        ("32Gi", "32"),
        ("1536Mi", "1.5"),
        ("1Ti", "1024"),
        ("1Mi", "0.0009765625"),
        ("1G", "0.931322574615478515625"),
        ("1", "0.000000000931322574615478515625"),
        ("1.5Gi", "1.5"),
        ("100Gi", "100"),
        (str(3 * 2**40 + 1), "3072.000000000931322574615478515625"),
    ],
)
def test_the_tier_size_renders_in_exact_gib(size: str, gib: str) -> None:
    """The text is the exact quotient: a float parse of it times 2**30 gives the bytes back."""
    tier = KVOffloadPolicy(size=size)
    assert tier.size_gib_text == gib
    assert float(gib) * 2**30 == tier.size_bytes


def test_autoscaling_defaults() -> None:
    spec = make_server({"autoscaling": {"maxReplicas": 4}}).spec.autoscaling
    assert spec is not None
    assert spec.to_api() == {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targets": {"kvCacheUsage": 0.8, "waitingRequests": 5.0, "runningRequests": 0.0},
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300,
    }


def test_a_stored_object_is_read_even_if_a_newer_rule_refuses_it() -> None:
    """What the API server stored under an earlier schema is reconciled, not rejected."""
    spec = {
        "runtime": "vllm",
        "shutdownGracePeriodSeconds": 30,
        "remediation": {
            "drainTimeoutSeconds": 120,
        },
    }
    assert DRAIN_RULE["message"] in _error_messages(spec)
    server = LLMServer.from_body(server_body(spec))
    assert server.spec.remediation.drain_timeout_seconds == 120
    # Rules as old as the stored object still hold.
    with pytest.raises(ValidationError, match="swapSpaceGiB must be 0"):
        LLMServer.from_body(server_body({"runtime": "vllm", "memoryPolicy": {"swapSpaceGiB": 1}}))


def test_status_conditions_lookup() -> None:
    server = make_server(
        status={"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}]}
    )
    ready = server.status.condition("Ready")
    assert ready is not None and ready.reason == "AllReplicasReady"
    assert server.status.condition("Degraded") is None


def test_small_example_is_valid() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "llmserver-small.yaml"
    server = LLMServer.model_validate(yaml.safe_load(path.read_text()))
    assert server.spec.memory_policy.swap_space_gib == 4.0
    assert server.spec.pod_template.volume_mounts[0].mount_path == "/models"
