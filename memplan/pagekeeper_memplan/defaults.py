"""The memory policy's defaults and bounds that both programs apply.

The operator's CRD (`pagekeeper_operator.api.policy`), the engine's flags
(`pagekeeper_engine.config`) and the plan (`plan.py`) read them here, so an unset field means
the same in the spec, on the engine's command line and in the plan.
"""

from __future__ import annotations

from typing import Final

# gpuMemoryUtilization / --gpu-memory-utilization: the fraction of the GPU's total memory one
# instance may use, in (0, MAX_GPU_MEMORY_UTILIZATION], DEFAULT_GPU_MEMORY_UTILIZATION when
# unset and no KV byte budget is given. The bound leaves room for the driver and whatever else
# the GPU holds outside the process.
DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.9
MAX_GPU_MEMORY_UTILIZATION: Final = 0.99

# blockSize / --block-size: tokens per KV block.
BLOCK_SIZES: Final = (8, 16, 32)
DEFAULT_BLOCK_SIZE: Final = 16

# Tokens per step when --max-num-batched-tokens is not given and chunked prefill is on: large
# enough to keep the GPU's matrix units busy on prefill, small enough that one chunk's
# activations stay a small share of memory.
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = 8192

# maxNumSeqs / --max-num-seqs: sequences running at once.
DEFAULT_MAX_NUM_SEQS: Final = 256

# prefixCacheMaxFraction / --prefix-cache-max-fraction: the share of KV blocks the prefix cache
# alone may hold.
DEFAULT_PREFIX_CACHE_MAX_FRACTION: Final = 0.5


def resolve_max_num_batched_tokens(
    max_num_batched_tokens: int | None, enable_chunked_prefill: bool, max_model_len: int
) -> int:
    """The per-step token budget: as given, else the default chunk, else room for a whole prompt
    (without chunking a prompt must fit in one step)."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    if enable_chunked_prefill:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
