"""The memory plan of one tensor-parallel rank, and whether it fits: pure arithmetic.

The terms are the engine's start-up budget's (`pagekeeper_engine/memory/budget.py`), predicted
from the model's shape, the policy and the GPU's memory instead of measured:

- weights (exact): the rank's tensors as the engine allocates them (`shape.rank_parameters`):
  2 bytes an element in bf16 / fp16, 4 in fp32; under FP8 weights the decoder layers'
  projections take 1 byte an element plus an fp32 scale per output row (per-channel), the
  embedding, LM head, norms and biases stay in the model's dtype; the fp32 rotary tables of
  `max_model_len` positions; less the GiB offloaded to host memory (`cpuOffloadGiB`, per GPU).
- activations: the preallocated step memory (exact, `activations.py`) plus
  `STEP_EXTRA_ESTIMATE` for what a step still allocates beside it (cuBLAS's workspaces, the
  decode kernel's split partials) -- an estimate.
- CUDA graphs: their private pool, `GRAPH_POOL_ESTIMATE` plus `GRAPH_ESTIMATE_EACH` per
  captured size (the workspace keeps a graph's tensors out of its pool) -- an estimate; the
  engine counts it among its peak activations.
- non-torch: the CUDA context with its loaded kernels (`CUDA_CONTEXT_ESTIMATE`) and, under
  tensor parallelism, NCCL's buffers and the peer-mapped all-reduce buffers
  (`NCCL_ESTIMATE`) -- estimates.
- fragmentation buffer: the byte size given, or under `auto` the rule's floor
  (`budget.MIN_FRAGMENTATION_BUFFER`; the engine measures the warm-up's own and doubles it,
  which the plan cannot know) -- a lower bound.
- KV cache: `kvCacheMemory` when set, else `budget.kv_cache_bytes` of `utilization x total`;
  its blocks less the host KV tier's GPU staging buffer when the tier is on
  (`budget.kv_cache_blocks`, the engine's own count).

The estimates are the terms the accuracy run on a GPU calibrates (docs/memory-policy.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagekeeper_memplan.activations import step_buffers_bytes
from pagekeeper_memplan.budget import (
    GiB,
    KVLayout,
    MiB,
    blocks_for,
    fragmentation_buffer,
    kv_cache_blocks,
    kv_cache_bytes,
    kv_offload_staging_blocks,
)
from pagekeeper_memplan.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    resolve_max_num_batched_tokens,
)
from pagekeeper_memplan.gpus import GpuModel
from pagekeeper_memplan.shape import (
    DTYPE_BYTES,
    ModelShape,
    RankShape,
    rank_parameters,
    split_error,
)

STEP_EXTRA_ESTIMATE = 128 * MiB
GRAPH_POOL_ESTIMATE = 64 * MiB
GRAPH_ESTIMATE_EACH = 1 * MiB
# What the engine measured outside the caching allocator on one H200 (torch 2.11, CUDA 13):
# 917 MiB for the 0.6B shape, 943-959 MiB for the 8B (docs/benchmarks.md, "Plan accuracy").
CUDA_CONTEXT_ESTIMATE = 928 * MiB
NCCL_ESTIMATE = 384 * MiB
TERMS = ("weights", "activations", "cudaGraphs", "nonTorch", "fragmentationBuffer", "kvCache")
ESTIMATED_TERMS = ("activations", "cudaGraphs", "nonTorch", "fragmentationBuffer")


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads from a policy (the LLMServer's effective one, or the CLI's)."""

    tp: int = 1
    dtype: str = "auto"  # auto, bfloat16, float16, float32
    quantization: Literal["none", "fp8"] = "none"
    cpu_offload_bytes: int = 0  # per GPU
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None  # bytes per GPU, instead of the utilization
    fragmentation_buffer: int | str = "auto"
    cuda_graphs: bool = True
    has_host_tier: bool = False  # the host KV tier (kvOffload) on: its staging takes blocks


@dataclass(frozen=True)
class Verdict:
    """Whether the plan fits; when not, the term that does not and by how many bytes."""

    fits: bool
    reason: str  # CamelCase, for the PolicyFits condition
    message: str
    term: str | None = None
    shortfall: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted budget (every rank's is the same or smaller) and what it holds."""

    gpu: GpuModel
    tp: int
    terms: dict[str, int]  # TERMS, bytes
    allowed: int  # what this instance may use: utilization x total, or the sum under a KV budget
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    verdict: Verdict

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_sequences(self) -> int:
        """maxModelLen-long sequences the KV cache holds at once."""
        return self.num_blocks // blocks_for(self.max_model_len, self.block_size)


def model_dtype_bytes(shape: ModelShape, dtype: str) -> int:
    """The engine's `--dtype` on a GPU: auto is the checkpoint's half type, else bfloat16."""
    if dtype == "auto":
        return DTYPE_BYTES.get(shape.torch_dtype or "", 2) if shape.torch_dtype != "float32" else 2
    return DTYPE_BYTES[dtype]


def weight_bytes(shape: ModelShape, inputs: PlanInputs, max_model_len: int) -> tuple[int, int]:
    """(the rank's weights in GPU memory before any offload, the bytes offload may move: the
    decoder layers' projections)."""
    params = rank_parameters(shape, inputs.tp, max_model_len)
    dtype_bytes = model_dtype_bytes(shape, inputs.dtype)
    if inputs.quantization == "fp8":
        linear = params.linear + params.linear_rows * 4
    else:
        linear = params.linear * dtype_bytes
    return linear + params.other * dtype_bytes + params.rotary * 4, linear


def kv_layout(shape: ModelShape, inputs: PlanInputs) -> KVLayout:
    """One rank's KV block (the engine's `runner/kv_cache.kv_layout`)."""
    rank = RankShape(shape, inputs.tp)
    dtype_bytes = 1 if inputs.kv_cache_dtype == "fp8" else model_dtype_bytes(shape, inputs.dtype)
    return KVLayout(
        shape.num_layers, rank.num_kv_heads, shape.head_dim, inputs.block_size, dtype_bytes
    )


def _graph_sizes(max_num_seqs: int) -> int:
    # runner/cuda_graphs.graph_batch_sizes: 1, 2, 4, 8, every multiple of 16, max_num_seqs
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16))
    return len(sizes | {max_num_seqs})


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def plan_memory(shape: ModelShape, inputs: PlanInputs, gpu: GpuModel) -> MemoryPlan:
    """The plan of one rank on `gpu`, and its verdict (the first problem found, in the order of
    the module docstring's terms)."""
    max_model_len = inputs.max_model_len or shape.max_position_embeddings
    tokens = resolve_max_num_batched_tokens(
        inputs.max_num_batched_tokens, inputs.enable_chunked_prefill, max_model_len
    )
    dtype_bytes = model_dtype_bytes(shape, inputs.dtype)
    on_gpu, offloadable = weight_bytes(shape, inputs, max_model_len)
    offload = min(inputs.cpu_offload_bytes, offloadable)
    weights = on_gpu - offload
    activations = STEP_EXTRA_ESTIMATE + step_buffers_bytes(
        shape, inputs.tp, tokens, inputs.max_num_seqs, dtype_bytes
    )
    graphs = 0
    if inputs.cuda_graphs:
        graphs = GRAPH_POOL_ESTIMATE + GRAPH_ESTIMATE_EACH * _graph_sizes(inputs.max_num_seqs)
    non_torch = CUDA_CONTEXT_ESTIMATE + (NCCL_ESTIMATE if inputs.tp > 1 else 0)
    buffer = fragmentation_buffer(0, inputs.fragmentation_buffer)
    total = gpu.memory_bytes
    others = weights + activations + graphs + non_torch + buffer
    if inputs.kv_cache_memory is not None:
        kv_cache = inputs.kv_cache_memory
        allowed = others + kv_cache
    else:
        utilization = inputs.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        allowed = int(utilization * total)
        kv_cache = kv_cache_bytes(allowed, weights, activations + graphs, non_torch, buffer)
    layout = kv_layout(shape, inputs)
    num_budget_blocks = max(kv_cache, 0) // layout.bytes_per_block
    num_blocks = max(
        0, kv_cache_blocks(num_budget_blocks, layout.bytes_per_block, inputs.has_host_tier)
    )
    terms = {
        "weights": weights,
        "activations": activations,
        "cudaGraphs": graphs,
        "nonTorch": non_torch,
        "fragmentationBuffer": buffer,
        "kvCache": max(kv_cache, 0),
    }
    verdict = judge(
        shape, inputs, gpu, terms, allowed, layout, num_blocks, max_model_len, offloadable, kv_cache
    )
    return MemoryPlan(
        gpu=gpu,
        tp=inputs.tp,
        terms=terms,
        allowed=allowed,
        block_size=inputs.block_size,
        bytes_per_block=layout.bytes_per_block,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        verdict=verdict,
    )


def judge(
    shape: ModelShape,
    inputs: PlanInputs,
    gpu: GpuModel,
    terms: dict[str, int],
    allowed: int,
    layout: KVLayout,
    num_blocks: int,
    max_model_len: int,
    offloadable: int,
    kv_cache: int,
) -> Verdict:
    """The first reason the plan does not fit, or that it fits."""
    tp = inputs.tp
    problem = split_error(shape, tp)
    if problem is not None:
        return Verdict(
            False, "ShapeDoesNotSplit", f"parallelism.tensor {tp}: {problem}", "parallelism"
        )
    if max_model_len > shape.max_position_embeddings:
        return Verdict(
            False,
            "MaxModelLenTooLong",
            f"maxModelLen {max_model_len} exceeds the model's "
            f"max_position_embeddings of {shape.max_position_embeddings}",
            "maxModelLen",
        )
    wants_fp8 = [
        name
        for name, on in (
            ("weights.quantization fp8", inputs.quantization == "fp8"),
            ("kvCacheDtype fp8", inputs.kv_cache_dtype == "fp8"),
        )
        if on
    ]
    if wants_fp8 and gpu.supports_fp8 is False:
        cc = ".".join(map(str, gpu.capability or ()))
        verb = "need" if len(wants_fp8) > 1 else "needs"
        return Verdict(
            False,
            "NoFP8OnGPU",
            f"{' and '.join(wants_fp8)} {verb} FP8 (compute capability 8.9 or newer); "
            f"{gpu.name} has {cc}",
            "weights.quantization" if inputs.quantization == "fp8" else "kvCacheDtype",
        )
    if inputs.cpu_offload_bytes > offloadable:
        return Verdict(
            False,
            "OffloadExceedsWeights",
            f"weights.cpuOffloadGiB {inputs.cpu_offload_bytes / GiB:g} exceeds the "
            f"{_gib(offloadable)} of projection weights a rank holds at tensor {tp}",
            "weights.cpuOffloadGiB",
            inputs.cpu_offload_bytes - offloadable,
        )
    total = gpu.memory_bytes
    weights = terms["weights"]
    if weights > total:
        return Verdict(
            False,
            "WeightsExceedGPU",
            f"weights alone take {_gib(weights)} a rank at tensor {tp}, more than the "
            f"{_gib(total)} of {gpu.name}; raise parallelism.tensor, quantize "
            f"(weights.quantization fp8) or offload (weights.cpuOffloadGiB)",
            "weights",
            weights - total,
        )
    if inputs.kv_cache_memory is not None and allowed > total:
        return Verdict(
            False,
            "BudgetExceedsGPU",
            f"kvCacheMemory {_gib(kv_cache)} and the other terms "
            f"({_gib(allowed - kv_cache)}) need {_gib(allowed)}, more than the "
            f"{_gib(total)} of {gpu.name}",
            "kvCacheMemory",
            allowed - total,
        )
    needed = blocks_for(max_model_len, inputs.block_size)
    if num_blocks < needed:
        num_staged = (
            kv_offload_staging_blocks(layout.bytes_per_block) if inputs.has_host_tier else 0
        )
        shortfall = (needed + num_staged) * layout.bytes_per_block - max(kv_cache, 0)
        staged = f" after the host tier's {num_staged} staging blocks" if num_staged else ""
        return Verdict(
            False,
            "KVCacheTooSmall",
            f"the KV cache gets {_gib(max(kv_cache, 0))} ({num_blocks} blocks{staged}) a "
            f"rank; one maxModelLen {max_model_len} sequence needs {needed} blocks "
            f"({_gib(needed * layout.bytes_per_block)})",
            "kvCache",
            shortfall,
        )
    tokens = num_blocks * inputs.block_size
    return Verdict(
        True,
        "Fits",
        f"{_gib(terms['kvCache'])} of KV cache a rank holds {tokens} tokens: "
        f"{num_blocks // needed} sequences of maxModelLen {max_model_len} at once",
    )
