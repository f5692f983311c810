"""`LLMServer.status.memoryPlan`: the memory plan the operator proved (or could not) before a
rollout (`pagekeeper_operator.policy.fit`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagekeeper_operator.api.types import ApiModel

PlanState = Literal["Fits", "DoesNotFit", "Unknown"]


class PlanTerms(ApiModel):
    """One tensor-parallel rank's budget, in bytes (every rank's is the same or smaller)."""

    weights: int = Field(description="The rank's weights in GPU memory (less CPU offload).")
    activations: int = Field(description="Preallocated step buffers and a step's extra (estimate).")
    cuda_graphs: int = Field(description="The CUDA graphs' private pool (estimate).")
    non_torch: int = Field(description="CUDA context; NCCL buffers under tensor > 1 (estimate).")
    fragmentation_buffer: int = Field(
        description="The byte size given, or auto's floor (the engine measures its own)."
    )
    kv_cache: int = Field(description="What is left for the KV cache, or kvCacheMemory.")


class HostTerms(ApiModel):
    """The pod's host memory by term, in bytes (`pagekeeper_memplan.host`)."""

    kv_offload: int = Field(description="The host KV tier (memoryPolicy.kvOffload.size).")
    swap_space: int = Field(description="swapSpaceGiB times parallelism.tensor, pinned.")
    cpu_offload: int = Field(description="weights.cpuOffloadGiB times parallelism.tensor, pinned.")
    shared_memory: int = Field(description="The memory-backed /dev/shm's size (a bound).")
    processes: int = Field(
        description=(
            "The processes' own memory (estimate): 3 GiB a GPU process (engine core and each "
            "further rank: torch, the CUDA libraries and context, loading), 1 GiB a front end."
        )
    )


class HostPlanStatus(ApiModel):
    """The pod's host memory, the memory it requests and is limited to, and the node."""

    per_pod: HostTerms = Field(description="The pod's terms, in bytes.")
    total: int = Field(description="Their sum: the host memory the pod needs.")
    memory_request: int | None = Field(
        default=None, description="The container's memory request (the spec's or the plan's)."
    )
    memory_limit: int | None = Field(
        default=None, description="The container's memory limit (the spec's or the plan's)."
    )
    node_allocatable: int | None = Field(
        default=None,
        description="The most allocatable memory of a candidate node (status.allocatable).",
    )
    node: str | None = Field(default=None, max_length=253, description="That node.")


class MemoryPlanStatus(ApiModel):
    """The predicted memory of one rank on the GPU the pods will get, the pod's host memory,
    and the verdict."""

    state: PlanState = Field(description="Fits, DoesNotFit, or Unknown (never blocks).")
    message: str = Field(default="", max_length=2048, description="The verdict, or why unknown.")
    term: str | None = Field(
        default=None, max_length=64, description="The field or term that does not fit."
    )
    shortfall: int | None = Field(default=None, description="Bytes missing for it to fit.")
    gpu: str | None = Field(default=None, max_length=256, description="The GPU assumed.")
    gpu_memory: int | None = Field(default=None, description="That GPU's memory in bytes.")
    gpu_source: str | None = Field(
        default=None,
        max_length=512,
        description=(
            "Where the GPU came from: the candidate nodes' NVIDIA GPU feature discovery labels "
            "(the smallest), spec.resources.gpuMemory or spec.resources.gpuType."
        ),
    )
    model: str | None = Field(
        default=None,
        max_length=512,
        description="Where the model's shape came from: the catalogue or spec.model.architecture.",
    )
    tensor: int | None = Field(default=None, description="Ranks (GPUs) per pod.")
    per_rank: PlanTerms | None = Field(default=None, description="One rank's terms, in bytes.")
    allowed: int | None = Field(
        default=None, description="Bytes this instance may use on one GPU (the terms' budget)."
    )
    estimated_terms: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="Terms that are estimates rather than exact arithmetic over the shapes.",
    )
    num_kv_blocks: int | None = Field(default=None, description="KV blocks a rank holds.")
    kv_tokens: int | None = Field(default=None, description="Tokens the KV cache holds.")
    max_concurrent_sequences: int | None = Field(
        default=None, description="Sequences of maxModelLen tokens the KV cache holds at once."
    )
    host: HostPlanStatus | None = Field(
        default=None,
        description=(
            "The pod's host memory: the KV tier, swap space, CPU weight offload, /dev/shm and "
            "the processes' own; it sets the memory request and limit the spec leaves unset "
            "where the policy pins host memory."
        ),
    )
