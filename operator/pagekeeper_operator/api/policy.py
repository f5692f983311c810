"""`LLMServer.spec.memoryPolicy`: the operator -> engine contract (docs/memory-policy.md).

Each field maps one-to-one onto an engine flag (or, for `allocator`, onto
`PYTORCH_CUDA_ALLOC_CONF`). Cross-field rules are CEL in the CRD and the same checks here.
"""

from __future__ import annotations

from decimal import Decimal, localcontext
from typing import Literal, get_args

from pydantic import ConfigDict, Field, model_validator

from pagekeeper_memplan.defaults import (
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFIX_CACHE_MAX_FRACTION,
    MAX_GPU_MEMORY_UTILIZATION,
)
from pagekeeper_operator.api.types import ApiModel, Quantity, cel, quantity_value, validations

BlockSize = Literal[8, 16, 32]
assert get_args(BlockSize) == BLOCK_SIZES, "BlockSize must list memplan's BLOCK_SIZES"
FRAGMENTATION_BUFFER_PATTERN = r"^(auto|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?)$"

BATCHED_TOKENS_RULE = cel(
    "!has(self.maxModelLen) || self.enableChunkedPrefill"
    " || self.maxNumBatchedTokens >= self.maxModelLen",
    "spec.memoryPolicy.maxNumBatchedTokens must be >= maxModelLen unless "
    "enableChunkedPrefill is true (a whole prompt must fit in one step)",
    ".maxNumBatchedTokens",
)
NUM_SEQS_RULE = cel(
    "self.maxNumSeqs <= self.maxNumBatchedTokens",
    "spec.memoryPolicy.maxNumSeqs must be <= maxNumBatchedTokens (each running sequence "
    "needs at least one token of the step budget)",
    ".maxNumSeqs",
)
BUDGETS_RULE = cel(
    "!(has(self.gpuMemoryUtilization) && has(self.kvCacheMemory))",
    "spec.memoryPolicy.kvCacheMemory and spec.memoryPolicy.gpuMemoryUtilization are mutually "
    "exclusive (a byte budget for the KV cache replaces the fraction of the GPU; set one)",
    ".kvCacheMemory",
)
KV_CACHE_MEMORY_RULE = cel(
    "!has(self.kvCacheMemory) || quantity(string(self.kvCacheMemory)).isGreaterThan(quantity('0'))",
    "spec.memoryPolicy.kvCacheMemory must be above 0 (bytes of KV cache per GPU)",
    ".kvCacheMemory",
)
KV_OFFLOAD_SIZE_RULE = cel(
    "quantity(string(self.size)).isGreaterThan(quantity('0'))",
    "spec.memoryPolicy.kvOffload.size must be above 0 (host memory of the KV tier per pod; "
    "leave kvOffload unset for no tier)",
    ".size",
)
KV_OFFLOAD_PREFIX_RULE = cel(
    "!has(self.kvOffload) || self.enablePrefixCaching",
    "spec.memoryPolicy.kvOffload needs enablePrefixCaching true (the host KV tier holds blocks "
    "the prefix cache evicts; without prefix caching nothing could be found there again)",
    ".kvOffload",
)
# A spec-level rule (it reads spec.runtime); LLMServerSpec carries it.
KV_OFFLOAD_BACKEND_RULE = cel(
    "self.runtime != 'pagekeeper' || !has(self.memoryPolicy.kvOffload)"
    " || self.memoryPolicy.kvOffload.backend == 'native'",
    "spec.memoryPolicy.kvOffload.backend must be native when spec.runtime is pagekeeper (the "
    "paged engine has its own host tier only; lmcache is vLLM's)",
    ".memoryPolicy.kvOffload.backend",
)
SPLIT_SIZE_RULE = cel(
    "!(self.expandableSegments && has(self.maxSplitSizeMb))",
    "spec.memoryPolicy.allocator.maxSplitSizeMb must not be set when expandableSegments is "
    "true (max_split_size_mb has no effect on expandable segments)",
    ".maxSplitSizeMb",
)


class AllocatorPolicy(ApiModel):
    """PyTorch CUDA caching-allocator options, passed as PYTORCH_CUDA_ALLOC_CONF."""

    model_config = ConfigDict(json_schema_extra=validations(SPLIT_SIZE_RULE))

    expandable_segments: bool = Field(
        default=True,
        description=(
            "expandable_segments: grow allocator segments in place instead of allocating new "
            "fixed-size ones, which keeps fragmentation low when batch shapes vary."
        ),
    )
    garbage_collection_threshold: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description=(
            "garbage_collection_threshold, in (0, 1): when reserved memory exceeds this fraction "
            "of the allowed memory, release cached blocks that are not in use."
        ),
    )
    max_split_size_mb: int | None = Field(
        default=None,
        gt=20,
        le=1_048_576,
        description=(
            "max_split_size_mb (> 20): never split cached blocks larger than this, so large "
            "blocks stay whole. Only without expandableSegments."
        ),
    )

    @model_validator(mode="after")
    def _check_split_size(self) -> AllocatorPolicy:
        if self.expandable_segments and self.max_split_size_mb is not None:
            raise ValueError(SPLIT_SIZE_RULE["message"])
        return self


class WeightsPolicy(ApiModel):
    """How the model's weights use GPU memory."""

    quantization: Literal["none", "fp8"] = Field(
        default="none",
        description=(
            "--quantization: none keeps the checkpoint's weights in the model's dtype; fp8 "
            "stores the decoder layers' projections in FP8 (e4m3) with a scale per output "
            "channel, about half the weight memory (the embedding and LM head stay in the "
            "model's dtype). Needs GPUs of compute capability 8.9 or newer; either runtime."
        ),
    )
    cpu_offload_gib: float = Field(
        default=0.0,
        alias="cpuOffloadGiB",
        ge=0.0,
        le=4096.0,
        description=(
            "--cpu-offload-gb: GiB of weights per GPU kept in pinned host memory and streamed "
            "to the GPU ahead of use; frees that much GPU memory for the KV cache, at a cost in "
            "step time. The pod's memory request must cover it (times parallelism.tensor); "
            "more than the weights is refused by the memory plan (PolicyFits)."
        ),
    )


GIB = 2**30


def gib_text(num_bytes: Decimal) -> str:
    """Bytes as GiB in the shortest exact decimal text (32Gi -> "32", 1536Mi -> "1.5").

    Exact for every quantity: a quantity is a decimal fraction, and dividing one by 2**30
    terminates within 30 more digits, which the context's precision holds.
    """
    with localcontext() as context:
        context.prec = 80
        gib = (num_bytes / GIB).normalize()  # normalize rounds to the context's precision too
    return format(gib, "f")


KVOffloadBackend = Literal["native", "lmcache"]


class KVOffloadPolicy(ApiModel):
    """A second tier of the prefix cache in the pod's host memory."""

    model_config = ConfigDict(json_schema_extra=validations(KV_OFFLOAD_SIZE_RULE))

    size: Quantity = Field(
        description=(
            "--kv-offloading-size (rendered in GiB): host memory of the KV tier per pod, total "
            "over the tensor-parallel ranks (each rank holds its shard of every block), e.g. "
            "32Gi. Size it to the reusable prefixes the GPU cannot keep (sessions x context x "
            "KV bytes per token) and within what the node can spare: the memory plan adds it to "
            "the pod's memory request and limit, and PolicyFits is False when no candidate "
            "node's allocatable memory holds the pod."
        ),
    )
    backend: KVOffloadBackend = Field(
        default="native",
        description=(
            "--kv-offloading-backend: native (the engine's own tier; the only one of runtime "
            "pagekeeper) or lmcache (vLLM's LMCache connector, runtime vllm only; the image "
            "must have LMCache installed)."
        ),
    )

    @property
    def size_bytes(self) -> int:
        return int(quantity_value(self.size))

    @property
    def size_gib_text(self) -> str:
        """The flag's value: the size in GiB, exact."""
        return gib_text(quantity_value(self.size))

    @model_validator(mode="after")
    def _check_size(self) -> KVOffloadPolicy:
        if quantity_value(self.size) <= 0:
            raise ValueError(KV_OFFLOAD_SIZE_RULE["message"])
        return self


class MemoryPolicy(ApiModel):
    """How the engine may use GPU memory; each field is one engine flag of the same name."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            BATCHED_TOKENS_RULE,
            NUM_SEQS_RULE,
            BUDGETS_RULE,
            KV_CACHE_MEMORY_RULE,
            KV_OFFLOAD_PREFIX_RULE,
        )
    )

    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_GPU_MEMORY_UTILIZATION,
        description=(
            f"--gpu-memory-utilization, in (0, {MAX_GPU_MEMORY_UTILIZATION}]: the fraction of "
            "the GPU's total memory this instance may use (weights, activations, fragmentation "
            f"buffer and KV cache). Unset, {DEFAULT_GPU_MEMORY_UTILIZATION} unless "
            "kvCacheMemory is set; mutually exclusive with kvCacheMemory."
        ),
    )
    kv_cache_memory: Quantity | None = Field(
        default=None,
        description=(
            "--kv-cache-memory-bytes: bytes of KV cache per GPU (e.g. 40Gi), instead of what "
            "gpuMemoryUtilization leaves; the rest of the GPU's memory is not budgeted, so it "
            "holds on GPUs shared with other processes. Mutually exclusive with "
            "gpuMemoryUtilization; either runtime."
        ),
    )
    weights: WeightsPolicy | None = Field(
        default=None,
        description="Weight memory: FP8 quantization and CPU offload. Unset: neither.",
    )
    block_size: BlockSize = Field(
        default=DEFAULT_BLOCK_SIZE,
        description="--block-size: tokens per KV-cache block, 8, 16 or 32.",
    )
    max_num_batched_tokens: int = Field(
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        ge=1,
        le=1_048_576,
        description=(
            "--max-num-batched-tokens: tokens per forward step (the prefill chunk budget); "
            "peak activation memory grows with it."
        ),
    )
    max_num_seqs: int = Field(
        default=DEFAULT_MAX_NUM_SEQS,
        ge=1,
        le=65_536,
        description="--max-num-seqs: sequences running at once.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=16_777_216,
        description=(
            "--max-model-len: longest prompt plus output in tokens; unset, the model's own "
            "context length."
        ),
    )
    swap_space_gib: float = Field(
        default=0.0,
        alias="swapSpaceGiB",
        ge=0.0,
        le=1024.0,
        description=(
            "--swap-space: GiB of pinned CPU memory per tensor-parallel rank for swapped-out "
            "KV blocks (each rank holds its shard); 0 preempts by recompute only. Only runtime "
            "pagekeeper supports it (vLLM's V1 engine has no KV swap), so it must be 0 with "
            "runtime vllm. A pool apart from kvOffload's (preempted sequences, not prefixes); "
            "the memory plan counts both in the pod's memory request and limit."
        ),
    )
    enable_chunked_prefill: bool = Field(
        default=True,
        description=(
            "--enable-chunked-prefill: split long prompts across steps so one prompt never "
            "needs more than maxNumBatchedTokens of activations."
        ),
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="--enable-prefix-caching: reuse KV blocks of identical prompt prefixes.",
    )
    prefix_cache_max_fraction: float = Field(
        default=DEFAULT_PREFIX_CACHE_MAX_FRACTION,
        ge=0.0,
        le=1.0,
        description=(
            "--prefix-cache-max-fraction: bound on the share of KV blocks held only by the "
            "prefix cache. Runtime pagekeeper only; not passed to vllm."
        ),
    )
    fragmentation_buffer: str = Field(
        default="auto",
        max_length=32,
        pattern=FRAGMENTATION_BUFFER_PATTERN,
        description=(
            "--fragmentation-buffer: GPU memory kept back from the KV cache for allocator "
            "fragmentation; 'auto' measures it at start-up, or a byte quantity such as 512Mi. "
            "Runtime pagekeeper only; not passed to vllm."
        ),
    )
    kv_offload: KVOffloadPolicy | None = Field(
        default=None,
        description=(
            "A host-memory tier of the prefix cache: KV blocks the GPU evicts are kept in "
            "pinned host memory and loaded back on a later prefix hit instead of recomputed. "
            "Use it for multi-turn chats and agents whose reusable prefixes outgrow the GPU's "
            "KV cache; it does nothing for unique single-shot prompts. Needs "
            "enablePrefixCaching. Independent of swapSpaceGiB (a separate host pool for "
            "preempted sequences; both count in the pod's memory). Unset: no tier."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description=(
            "--kv-cache-dtype: auto keeps keys and values in the model's dtype; fp8 (e4m3) stores "
            "each in one byte, so the same memory holds about twice the tokens, at a small cost "
            "in accuracy (docs/memory-policy.md). fp8 needs GPUs of compute capability 8.9 or "
            "newer (L4, L40S, H100, H200, B200); either runtime."
        ),
    )
    allocator: AllocatorPolicy = Field(
        default_factory=AllocatorPolicy,
        description="CUDA caching-allocator options (env PYTORCH_CUDA_ALLOC_CONF).",
    )

    @property
    def effective_utilization(self) -> float | None:
        """The fraction of the GPU this instance may use; None under a KV byte budget."""
        if self.kv_cache_memory is not None:
            return self.gpu_memory_utilization
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION

    def with_budget_resolved(self) -> MemoryPolicy:
        """This policy with its budget spelled out: gpuMemoryUtilization 0.9 where neither it
        nor kvCacheMemory is set, so status, the step-down, the tuner and `kubectl get` read the
        value in force."""
        utilization = self.effective_utilization
        if utilization == self.gpu_memory_utilization:
            return self
        return self.model_copy(update={"gpu_memory_utilization": utilization})

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        if self.kv_cache_memory is None:
            return None
        return int(quantity_value(self.kv_cache_memory))

    @property
    def weight_policy(self) -> WeightsPolicy:
        return self.weights or WeightsPolicy()

    @model_validator(mode="after")
    def _check_budgets(self) -> MemoryPolicy:
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError(BUDGETS_RULE["message"])
        if self.kv_cache_memory is not None and quantity_value(self.kv_cache_memory) <= 0:
            raise ValueError(KV_CACHE_MEMORY_RULE["message"])
        if (
            self.max_model_len is not None
            and not self.enable_chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(BATCHED_TOKENS_RULE["message"])
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(NUM_SEQS_RULE["message"])
        if self.kv_offload is not None and not self.enable_prefix_caching:
            raise ValueError(KV_OFFLOAD_PREFIX_RULE["message"])
        return self

    def runtime_violation(self, runtime: str) -> str | None:
        """The message of the policy rule `runtime` breaks, if any (KV_OFFLOAD_BACKEND_RULE)."""
        tier = self.kv_offload
        if runtime == "pagekeeper" and tier is not None and tier.backend != "native":
            return KV_OFFLOAD_BACKEND_RULE["message"]
        return None
