"""What `pagekeeper-engine serve` was asked to do (`EngineConfig`), and `parse_args`, which
reads the flag table (`flags.build_parser`) and refuses combinations of flags that cannot work
together, naming the flag.

This module imports neither torch nor anything heavy: the operator's contract test parses
rendered args with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from pagekeeper_engine.flags import DEFAULT_STUCK_TIMEOUT_S, WAITING_PER_RUNNING_SLOT, build_parser
from pagekeeper_engine.kv_events_config import KVEventsConfig
from pagekeeper_memplan.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFIX_CACHE_MAX_FRACTION,
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `pagekeeper-engine serve` was asked to do, validated."""

    model: str
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    dtype: str = "auto"
    device: str = "cuda"
    load_format: str = "auto"
    seed: int = 0
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None  # the KV cache's bytes per GPU, when given
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    swap_space: float = 4.0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_cache_max_fraction: float = DEFAULT_PREFIX_CACHE_MAX_FRACTION
    fragmentation_buffer: int | Literal["auto"] = "auto"
    num_cpu_blocks_override: int | None = None
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    # None: on where the runner prefers it (CUDA), off elsewhere
    async_scheduling: bool | None = None
    shutdown_timeout: float = 30.0
    admin_token_env: str = "PAGEKEEPER_ADMIN_TOKEN"
    api_key: str | None = None  # the bearer token /v1/* requests must carry, when given
    max_waiting_requests: int | None = None
    max_consecutive_ooms: int = 8
    stuck_timeout: float = DEFAULT_STUCK_TIMEOUT_S  # 0: no progress watchdog
    termination_log_path: str = "/dev/termination-log"
    api_server_count: int = 1
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    # None: the checkpoint's (config.json quantization_config), else none
    quantization: str | None = None
    cpu_offload_gb: float = 0.0
    # The host KV tier's pinned host memory in GiB, total over the tensor-parallel ranks (each
    # holds its shard); 0: no tier. vLLM's flag and meaning.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # Where KV cache events go (vLLM's --kv-events-config); None: no events.
    kv_events_config: KVEventsConfig | None = None
    kv_events_encoding: str = "array"  # kv_events_wire: "array" (vLLM 0.11) or "map" (0.33)

    @property
    def is_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def max_num_in_flight(self) -> int:
        """Sequences admitted at once: the running slots plus the bounded waiting queue."""
        waiting = self.max_waiting_requests
        if waiting is None:
            waiting = WAITING_PER_RUNNING_SLOT * self.max_num_seqs
        return self.max_num_seqs + waiting


def parse_args(argv: list[str]) -> EngineConfig:
    """Parse `serve` arguments; exits with status 2 and a message naming the flag on error."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if namespace.kv_cache_dtype != "auto" and namespace.device == "cpu":
        parser.error(
            "argument --kv-cache-dtype: fp8 needs a CUDA GPU (the CPU has no FP8 path); "
            "use --kv-cache-dtype auto with --device cpu"
        )
    if namespace.kv_cache_memory_bytes is not None and namespace.gpu_memory_utilization is not None:
        parser.error(
            "argument --kv-cache-memory-bytes: not allowed with --gpu-memory-utilization "
            "(the KV cache is sized either by bytes or by a fraction of the GPU, not both)"
        )
    if namespace.api_key is not None and (
        not namespace.api_key or namespace.api_key.strip() != namespace.api_key
    ):
        # An empty key would leave /v1/* open, and one with surrounding whitespace (a Secret
        # made from a file's trailing newline) can never arrive in an HTTP header.
        parser.error(
            "argument --api-key: the key is empty or begins or ends with whitespace; no "
            "request could carry it (check the Secret's value for a trailing newline)"
        )
    if namespace.kv_offloading_size > 0 and not namespace.enable_prefix_caching:
        parser.error(
            "argument --kv-offloading-size: the host KV tier is a tier of the prefix cache; "
            "it needs --enable-prefix-caching (drop --no-enable-prefix-caching or set 0)"
        )
    events = namespace.kv_events_config
    if events is not None and events.enable_kv_cache_events and not namespace.enable_prefix_caching:
        parser.error(
            "argument --kv-events-config: enable_kv_cache_events reports the prefix cache's "
            "blocks; it needs --enable-prefix-caching (drop --no-enable-prefix-caching or set "
            "enable_kv_cache_events to false)"
        )
    if namespace.gpu_memory_utilization is None:
        namespace.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(namespace).items() if k in names})
