"""The fit gate (pure): the GPU and model the plan assumes, its verdict as status and
condition, and the rollout it holds."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagekeeper_memplan.budget import kv_offload_staging_blocks
from pagekeeper_memplan.gpus import GpuModel, MiB
from pagekeeper_operator.policy.effective import effective_memory_policy, memory_policy_hash
from pagekeeper_operator.policy.fit import (
    candidate_gpu,
    decide_fit,
    hold_rollout,
    model_shape,
    node_selector,
)
from pagekeeper_operator.status.conditions import compute_status
from tests.operator.servers import make_server

NOW = "2026-11-29T01:00:00Z"
LLAMA_70B = {
    "model": {"source": "/models/Llama-3.1-70B-Instruct"},
    "memoryPolicy": {"maxModelLen": 32768},
}


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


H100 = node(
    "gpu-a", **{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"}
)
H200 = node("gpu-b", **{"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.memory": "143771"})
CPU = node("cpu-a")


def fit_of(spec: dict[str, Any], nodes: list[dict[str, Any]]) -> Any:
    server = make_server(spec)
    return decide_fit(server, effective_memory_policy(server), nodes)


def test_the_smallest_labelled_candidate_is_assumed() -> None:
    gpu, source = candidate_gpu(make_server(), [H200, CPU, H100])
    assert gpu == GpuModel("NVIDIA-H100-80GB-HBM3", 81559 * MiB, (9, 0))
    assert (
        source == "the smallest GPU of 2 candidate node(s)' feature-discovery labels (node gpu-a)"
    )


def test_the_pods_node_selector_picks_the_candidates() -> None:
    server = make_server(
        {"resources": {"gpuType": "NVIDIA-H200"}, "podTemplate": {"nodeSelector": {"pool": "big"}}}
    )
    assert node_selector(server) == {"pool": "big", "nvidia.com/gpu.product": "NVIDIA-H200"}
    pooled = node("gpu-c", pool="big", **{"nvidia.com/gpu.product": "NVIDIA-H200"})
    gpu, _ = candidate_gpu(server, [H100, H200, pooled])
    assert gpu == GpuModel("NVIDIA-H200", 143771 * MiB, (9, 0))


def test_without_labels_the_spec_says() -> None:
    memory = make_server({"resources": {"gpuMemory": "40Gi", "gpuType": "NVIDIA-L40S"}})
    assert candidate_gpu(memory, [CPU]) == (
        GpuModel("NVIDIA-L40S", 40 << 30, (8, 9)),
        "spec.resources.gpuMemory",
    )
    typed = make_server({"resources": {"gpuType": "NVIDIA-A100-SXM4-40GB"}})
    assert candidate_gpu(typed, []) == (
        GpuModel("A100-40GB", 40960 * MiB, (8, 0)),
        "spec.resources.gpuType",
    )
    assert candidate_gpu(make_server(), [CPU])[0] is None


def test_the_models_shape_from_the_spec_or_the_catalogue() -> None:
    arch = {
        "modelType": "qwen3",
        "vocabSize": 1000,
        "hiddenSize": 64,
        "intermediateSize": 128,
        "numHiddenLayers": 2,
        "numAttentionHeads": 4,
        "numKeyValueHeads": 2,
    }
    shape, source = model_shape(make_server({"model": {"architecture": arch}}))
    assert source == "spec.model.architecture"
    assert shape is not None and (shape.has_qk_norm, shape.head_dim) == (True, 16)
    assert model_shape(make_server())[1] == "the catalogue's qwen3-0.6b"
    unknown = make_server({"model": {"source": "org/private-model"}})
    assert model_shape(unknown) == (
        None,
        "the operator's catalogue does not know 'org/private-model' and "
        "spec.model.architecture is unset",
    )


def test_70b_at_tensor_1_on_80gb_holds_the_rollout() -> None:
    fit = fit_of(LLAMA_70B, [H100, H200])
    assert fit.holds_rollout
    status, reason, message = fit.condition
    assert (status, reason) == ("False", "WeightsExceedGPU")
    assert message.endswith("; the rollout is held (running pods keep their template)")
    plan = fit.status
    assert (plan.state, plan.term, plan.gpu, plan.gpu_memory) == (
        "DoesNotFit",
        "weights",
        "NVIDIA-H100-80GB-HBM3",
        81559 * MiB,
    )
    assert plan.per_rank is not None
    assert plan.shortfall == plan.per_rank.weights - 81559 * MiB


def test_70b_fits_at_tensor_4_or_with_fp8_weights_at_tensor_2() -> None:
    for change in (
        {"parallelism": {"tensor": 4}},
        {"parallelism": {"tensor": 2}, "memoryPolicy": {"weights": {"quantization": "fp8"}}},
    ):
        fit = fit_of(
            {
                **LLAMA_70B,
                **change,
                "memoryPolicy": {**LLAMA_70B["memoryPolicy"], **change.get("memoryPolicy", {})},
            },
            [H100],
        )
        assert not fit.holds_rollout
        assert fit.condition[:2] == ("True", "Fits")
        assert fit.status.state == "Fits" and fit.status.max_concurrent_sequences >= 1


def test_a_host_tier_plans_the_engines_pool_less_its_staging() -> None:
    # 70B at tensor 4, bf16, 16-token blocks: 80 layers x 2 KV heads x 128 x 2 x 2 bytes x 16
    # = 1.25 MiB a block; the staging buffer takes the engine's count of them.
    spec = {**LLAMA_70B, "parallelism": {"tensor": 4}}
    tiered = {**spec, "memoryPolicy": {"maxModelLen": 32768, "kvOffload": {"size": "64Gi"}}}
    base, with_tier = fit_of(spec, [H100]).plan, fit_of(tiered, [H100]).plan
    assert base is not None and with_tier is not None
    assert base.bytes_per_block == 1280 * 1024
    assert base.num_blocks - with_tier.num_blocks == kv_offload_staging_blocks(1280 * 1024)
    assert base.num_blocks - with_tier.num_blocks in range(48, 52)  # about 64 MiB of blocks


def test_unknown_never_holds() -> None:
    for spec, reason in (
        ({"model": {"source": "org/private-model"}}, "ModelShapeUnknown"),
        ({}, "GPUUnknown"),
        ({"resources": {"gpus": 0}}, "RunsOnCPU"),
    ):
        fit = fit_of(spec, [CPU])
        assert (fit.holds_rollout, fit.condition[:2]) == (False, ("Unknown", reason))
        assert fit.status.state == "Unknown"


def test_fp8_on_a_gpu_without_it_is_a_verdict_naming_the_gpu() -> None:
    a100 = node("gpu-z", **{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
    fit = fit_of(
        {"memoryPolicy": {"weights": {"quantization": "fp8"}, "maxModelLen": 8192}}, [a100]
    )
    assert fit.condition[:2] == ("False", "NoFP8OnGPU")
    assert "NVIDIA-A100-SXM4-80GB has 8.0" in fit.condition[2]


def test_offload_larger_than_the_weights_is_a_verdict() -> None:
    fit = fit_of({"memoryPolicy": {"weights": {"cpuOffloadGiB": 4}, "maxModelLen": 8192}}, [H100])
    assert (fit.condition[1], fit.status.term) == ("OffloadExceedsWeights", "weights.cpuOffloadGiB")


DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "qwen"},
    "spec": {"replicas": 2, "template": {"metadata": {"labels": {"new": "1"}}}},
}
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "qwen"}}


def test_a_held_rollout_keeps_the_running_template_or_makes_no_deployment() -> None:
    running = {"spec": {"replicas": 2, "template": {"metadata": {"labels": {"old": "1"}}}}}
    held = hold_rollout([DEPLOYMENT, SERVICE], running)
    assert held[0]["spec"] == {"replicas": 2, "template": {"metadata": {"labels": {"old": "1"}}}}
    assert held[1] == SERVICE
    assert hold_rollout([DEPLOYMENT, SERVICE], None) == [SERVICE]


def test_servers_without_the_new_fields_keep_their_policy_hash() -> None:
    """The hash from before kvCacheMemory and weights existed: no pod rolls on an upgrade."""
    server = make_server({"memoryPolicy": {"maxModelLen": 4096}})
    old_dump = effective_memory_policy(server).model_dump(by_alias=True, mode="json")
    del old_dump["kvCacheMemory"], old_dump["weights"]
    assert old_dump["gpuMemoryUtilization"] == 0.9
    text = json.dumps(old_dump, sort_keys=True)
    expected = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert memory_policy_hash(server.spec.memory_policy) == expected
    assert memory_policy_hash(effective_memory_policy(server)) == expected
    fp8 = make_server({"memoryPolicy": {"maxModelLen": 4096, "weights": {"quantization": "fp8"}}})
    assert memory_policy_hash(fp8.spec.memory_policy) != expected


def test_status_carries_the_plan_and_its_condition() -> None:
    server = make_server(LLAMA_70B)
    fit = decide_fit(server, effective_memory_policy(server), [H100])
    status = compute_status(server, None, NOW, fit=fit)
    condition = status.condition("PolicyFits")
    assert condition is not None and (condition.status, condition.reason) == (
        "False",
        "WeightsExceedGPU",
    )
    assert status.memory_plan == fit.status
    # A refresh without a new plan (a Deployment event) keeps the last one.
    refreshed = make_server(LLAMA_70B, status=status.to_api())
    again = compute_status(refreshed, None, NOW)
    assert again.memory_plan == fit.status
    assert again.condition("PolicyFits") == condition
