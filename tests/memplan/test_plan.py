"""The plan's terms in exact bytes, and its verdicts."""

from __future__ import annotations

import pytest

from pagekeeper_memplan.budget import GiB, MiB, kv_offload_staging_blocks
from pagekeeper_memplan.gpus import GpuModel, parse_product
from pagekeeper_memplan.plan import MemoryPlan, PlanInputs, plan_memory
from pagekeeper_memplan.shape import ModelShape, known_shape

H100 = parse_product("H100-80GB")
A100 = parse_product("A100-80GB")
L4 = parse_product("L4")


def shape(name: str) -> ModelShape:
    found = known_shape(name)
    assert found is not None
    return found


def plan(name: str, gpu: GpuModel | None, **inputs: object) -> MemoryPlan:
    assert gpu is not None
    return plan_memory(shape(name), PlanInputs(**inputs), gpu)  # type: ignore[arg-type]


def test_qwen3_small_on_an_h100_term_by_term() -> None:
    result = plan("Qwen3-0.6B", H100, max_model_len=8192)
    # 28 layers of qkv 1024 x 4096, o 2048 x 1024, gate_up 1024 x 6144, down 3072 x 1024;
    # norms 2 x 1024 + q/k norms 2 x 128 a layer; the tied embedding 151936 x 1024; final norm.
    params = 28 * (1024 * 4096 + 2048 * 1024 + 1024 * 6144 + 3072 * 1024 + 2 * 1024 + 2 * 128)
    params += 151936 * 1024 + 1024
    assert params == 596_049_920
    rotary = 2 * 8192 * 64 * 4
    workspace = 2 * 8192 * (2 * 1024 + 2048 + 2 * 1024 + 2048 + 3 * 3072) + 57 * 1024 * 4
    cut = 6 * (151936 * 21 + 4) + 151936 * 8  # 2^20 // 151936 = 6 rows
    pick = 256 * 8 + 512 * 8 + 5 * 256 * 75 * 4 + 256 * 4
    sampler = 256 * 151936 * (2 + 3 * 4) + cut + pick
    activations = workspace + sampler + 128 * MiB
    graphs = 64 * MiB + 20 * MiB  # 1, 2, 4, 8 and 16 multiples of 16 up to 256
    total = 81559 * MiB
    allowed = int(0.9 * total)
    kv = allowed - (2 * params + rotary) - activations - graphs - 928 * MiB - 64 * MiB
    assert result.terms == {
        "weights": 2 * params + rotary,
        "activations": activations,
        "cudaGraphs": graphs,
        "nonTorch": 928 * MiB,
        "fragmentationBuffer": 64 * MiB,
        "kvCache": kv,
    }
    assert result.allowed == allowed
    assert result.bytes_per_block == 2 * 28 * 16 * 8 * 128 * 2
    assert result.num_blocks == kv // result.bytes_per_block
    assert result.kv_tokens == result.num_blocks * 16
    assert result.max_concurrent_sequences == result.num_blocks // 512
    assert result.verdict.fits
    assert result.verdict.reason == "Fits"


def test_fp8_weights_take_a_byte_and_a_scale_a_row() -> None:
    bf16 = plan("Llama-3.1-8B", H100, max_model_len=8192)
    fp8 = plan("Llama-3.1-8B", H100, max_model_len=8192, quantization="fp8")
    projections = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096)
    rows = 32 * (6144 + 4096 + 2 * 14336 + 4096)
    assert bf16.terms["weights"] - fp8.terms["weights"] == 2 * projections - (
        projections + 4 * rows
    )


def test_offload_moves_weights_to_the_host() -> None:
    base = plan("Llama-3.1-8B", H100, max_model_len=8192)
    offloaded = plan("Llama-3.1-8B", H100, max_model_len=8192, cpu_offload_bytes=8 * GiB)
    assert base.terms["weights"] - offloaded.terms["weights"] == 8 * GiB
    assert offloaded.terms["kvCache"] - base.terms["kvCache"] == 8 * GiB


def test_a_kv_byte_budget_replaces_the_utilization() -> None:
    result = plan("Llama-3.1-8B", H100, max_model_len=8192, kv_cache_memory=20 * GiB)
    assert result.terms["kvCache"] == 20 * GiB
    assert result.allowed == sum(result.terms.values())
    assert result.verdict.fits


def test_70b_at_tensor_1_on_80gb_does_not_fit_its_weights() -> None:
    result = plan("Llama-3.1-70B", H100, max_model_len=32768)
    verdict = result.verdict
    assert (verdict.fits, verdict.reason, verdict.term) == (False, "WeightsExceedGPU", "weights")
    assert verdict.shortfall == result.terms["weights"] - 81559 * MiB
    assert verdict.message.startswith("weights alone take 131.43 GiB a rank at tensor 1, more ")


@pytest.mark.parametrize(("tp", "quantization"), [(4, "none"), (2, "fp8"), (8, "none")])
def test_70b_fits_split_or_quantized(tp: int, quantization: str) -> None:
    result = plan("Llama-3.1-70B", H100, tp=tp, quantization=quantization, max_model_len=32768)
    assert result.verdict.fits, result.verdict.message
    assert result.max_concurrent_sequences >= 1


def test_kv_cache_that_cannot_hold_one_sequence() -> None:
    result = plan("Llama-3.1-8B", L4)  # the model's whole 131072-token context on 22.5 GiB
    verdict = result.verdict
    assert (verdict.fits, verdict.reason, verdict.term) == (False, "KVCacheTooSmall", "kvCache")
    needed = 131072 // 16 * result.bytes_per_block
    assert verdict.shortfall == needed - result.terms["kvCache"]


def test_the_host_tiers_staging_comes_out_of_the_kv_blocks() -> None:
    # The engine's count (`budget.kv_cache_blocks`): about 64 MiB of blocks leave the pool for
    # the tier's GPU staging; 8B bf16, 16-token blocks: 2 MiB a block.
    base = plan("Llama-3.1-8B", H100, max_model_len=8192)
    tiered = plan("Llama-3.1-8B", H100, max_model_len=8192, has_host_tier=True)
    assert base.bytes_per_block == 2 * MiB
    assert tiered.terms == base.terms
    num_staged = kv_offload_staging_blocks(2 * MiB)
    assert num_staged == 32
    assert base.num_blocks - tiered.num_blocks == num_staged
    assert tiered.verdict.fits


def test_a_kv_cache_the_staging_leaves_short_of_one_sequence() -> None:
    # 8192 tokens need 512 blocks of 2 MiB: a budget of exactly 512 holds them without the
    # tier, and with it 512 less the staging's 32, 64 MiB short.
    budget = 512 * 2 * MiB
    without = plan("Llama-3.1-8B", H100, max_model_len=8192, kv_cache_memory=budget)
    assert without.verdict.fits
    result = plan(
        "Llama-3.1-8B", H100, max_model_len=8192, kv_cache_memory=budget, has_host_tier=True
    )
    verdict = result.verdict
    assert (verdict.fits, verdict.reason, verdict.term) == (False, "KVCacheTooSmall", "kvCache")
    assert verdict.shortfall == 64 * MiB
    assert "(480 blocks after the host tier's 32 staging blocks)" in verdict.message


def test_a_kv_budget_larger_than_the_gpu() -> None:
    result = plan("Qwen3-8B", H100, max_model_len=8192, kv_cache_memory=70 * GiB)
    verdict = result.verdict
    assert (verdict.reason, verdict.term) == ("BudgetExceedsGPU", "kvCacheMemory")
    assert verdict.shortfall == result.allowed - 81559 * MiB


def test_fp8_on_a_gpu_without_it_names_the_gpu() -> None:
    verdict = plan("Qwen3-8B", A100, max_model_len=8192, quantization="fp8").verdict
    assert (verdict.reason, verdict.term) == ("NoFP8OnGPU", "weights.quantization")
    assert verdict.message == (
        "weights.quantization fp8 needs FP8 (compute capability 8.9 or newer); A100-80GB has 8.0"
    )
    unknown = GpuModel("unknown product", 80 * GiB, None)
    assert plan("Qwen3-8B", unknown, max_model_len=8192, quantization="fp8").verdict.fits


def test_offload_beyond_the_projection_weights() -> None:
    verdict = plan("Qwen3-0.6B", H100, max_model_len=8192, cpu_offload_bytes=4 * GiB).verdict
    projections = 2 * 28 * (1024 * 4096 + 2048 * 1024 + 1024 * 6144 + 3072 * 1024)
    assert (verdict.reason, verdict.term) == ("OffloadExceedsWeights", "weights.cpuOffloadGiB")
    assert verdict.shortfall == 4 * GiB - projections


def test_shapes_that_do_not_split_and_contexts_beyond_the_model() -> None:
    split = plan("Qwen2.5-7B", H100, tp=8, max_model_len=8192).verdict
    assert (split.reason, split.message) == (
        "ShapeDoesNotSplit",
        "parallelism.tensor 8: 28 attention heads do not split evenly over 8 ranks",
    )
    long = plan("Qwen3-0.6B", H100, max_model_len=65536).verdict
    assert (long.reason, long.term) == ("MaxModelLenTooLong", "maxModelLen")
