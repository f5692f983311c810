"""The parts of `LLMServer.spec` that shape the pods: the model, per-pod resources, tensor
parallelism, the Service and the PodDisruptionBudget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagekeeper_operator.api.types import (
    MAX_NAME_LENGTH,
    STRING_MAP,
    ApiModel,
    Quantity,
)


class ModelArchitecture(ApiModel):
    """The config.json fields the memory plan reads, for a model its catalogue does not know."""

    model_type: Literal["llama", "qwen2", "qwen3", "mistral"] = Field(
        default="llama", description="config.json model_type."
    )
    vocab_size: int = Field(ge=1, le=16_777_216, description="vocab_size.")
    hidden_size: int = Field(ge=1, le=1_048_576, description="hidden_size.")
    intermediate_size: int = Field(ge=1, le=4_194_304, description="intermediate_size.")
    num_hidden_layers: int = Field(ge=1, le=4096, description="num_hidden_layers.")
    num_attention_heads: int = Field(ge=1, le=4096, description="num_attention_heads.")
    num_key_value_heads: int | None = Field(
        default=None, ge=1, le=4096, description="num_key_value_heads; unset, the heads."
    )
    head_dim: int | None = Field(
        default=None, ge=1, le=4096, description="head_dim; unset, hidden / heads."
    )
    max_position_embeddings: int = Field(
        default=2048, ge=1, le=16_777_216, description="max_position_embeddings."
    )
    tie_word_embeddings: bool = Field(default=False, description="tie_word_embeddings.")
    torch_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None, description="torch_dtype: the checkpoint's weight type."
    )

    def config_json(self) -> dict[str, object]:
        """The fields as config.json spells them."""
        return self.model_dump(exclude_none=True)


class ModelSource(ApiModel):
    """The model the engine serves."""

    source: str = Field(
        min_length=1,
        max_length=2048,
        description=(
            "Path inside the pod (for example a mounted volume) or URI the engine loads: a "
            "Hugging Face checkpoint directory for runtime pagekeeper; anything `vllm serve` "
            "accepts for runtime vllm."
        ),
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="--served-model-name: the name clients use; unset, the source.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="--dtype of weights and activations."
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        default="auto",
        description="--load-format; dummy builds random weights at the model's real shape.",
    )
    architecture: ModelArchitecture | None = Field(
        default=None,
        description=(
            "The model's shape, for the memory plan (status.memoryPlan, PolicyFits) where the "
            "operator's catalogue does not know the source's name (docs/memory-policy.md lists "
            "it). Unset and unknown: the plan says Unknown and never blocks a rollout."
        ),
    )


class ComputeQuantities(ApiModel):
    """CPU and memory amounts for the engine container."""

    cpu: Quantity | None = Field(default=None, description="CPU cores, e.g. 8 or 500m.")
    memory: Quantity | None = Field(default=None, description="Host memory, e.g. 64Gi.")


class Resources(ApiModel):
    """What one pod gets: GPUs and their type, CPU, host memory and shared memory."""

    gpus: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description=(
            "nvidia.com/gpu per pod; unset, spec.parallelism.tensor (one GPU per rank). 0 runs "
            "the pagekeeper engine on the CPU (with spec.parallelism.tensor 1)."
        ),
    )
    shared_memory: Quantity | None = Field(
        default=None,
        description=(
            "Size of the pod's memory-backed /dev/shm (NCCL's buffers between the ranks of one "
            "pod live there; it counts against the pod's memory). Unset: 1Gi per GPU, at "
            "least 1Gi (4Gi for a tensor-parallel size of 4)."
        ),
    )
    gpu_type: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description=(
            "GPU product the pod must land on, matched against the node label "
            "nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3)."
        ),
    )
    gpu_memory: Quantity | None = Field(
        default=None,
        description=(
            "Memory of one GPU (e.g. 80Gi), for the memory plan where no candidate node carries "
            "NVIDIA GPU feature discovery labels (nvidia.com/gpu.memory, nvidia.com/gpu.product)."
        ),
    )
    requests: ComputeQuantities = Field(
        default_factory=ComputeQuantities, description="CPU and memory requests."
    )
    limits: ComputeQuantities = Field(
        default_factory=ComputeQuantities, description="CPU and memory limits."
    )


class ParallelismSpec(ApiModel):
    """How one model is split over the GPUs of one pod."""

    tensor: Literal[1, 2, 4, 8] = Field(
        default=1,
        description=(
            "--tensor-parallel-size: GPUs one model is split over (its layers' weights and KV "
            "heads), for either runtime. The pod asks for that many GPUs and gets a "
            "memory-backed /dev/shm for the ranks' collectives; an eviction takes the whole pod."
        ),
    )
    custom_all_reduce: bool = Field(
        default=True,
        description=(
            "With tensor > 1: let the runtime sum small messages between the GPUs over "
            "peer-mapped memory where that beats NCCL (the pagekeeper engine times both at "
            "start-up on every rank; vLLM has its own custom all-reduce). false renders "
            "--disable-custom-all-reduce for either runtime: NCCL for every all-reduce. No "
            "effect with tensor 1."
        ),
    )


class ServiceSpec(ApiModel):
    """The Service in front of the pods (OpenAI-compatible HTTP and /metrics)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Service type."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Port the Service listens on.")
    annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=STRING_MAP, description="Service annotations."
    )


class DisruptionBudgetSpec(ApiModel):
    """Who provides the PodDisruptionBudget that every eviction of the pods must respect."""

    managed: bool = Field(
        default=True,
        description=(
            "true: the operator renders a PodDisruptionBudget allowing "
            "spec.remediation.maxUnavailable pods down at a time. false: bring your own (the "
            "operator deletes the one it made); the operator's evictions then obey yours. A pod "
            "covered by two budgets cannot be evicted at all, so keep only one."
        ),
    )


class ApiKeySpec(ApiModel):
    """Where the OpenAI endpoints' API key lives: a key of a Secret in the server's namespace."""

    secret_name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The Secret's name (in the LLMServer's namespace).",
    )
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key in the Secret's data whose value is the API key.",
    )
