"""The arithmetic the engine's start-up budget and the operator's plan share: the KV block's
bytes, the fragmentation buffer's rule and the KV cache's formula

    kv_cache = allowed - weights - peak_activations - non_torch - fragmentation_buffer

The engine feeds it measured terms (`pagekeeper_engine/memory/budget.py`), the plan predicted
ones (`plan.py`); neither restates it.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# Reserved-but-unallocated memory measured after the warm-up is multiplied by this: the warm-up
# sees a few minutes' worth of shapes, production sees days' worth.
FRAGMENTATION_SAFETY_FACTOR = 2.0
# Never budget less than this for fragmentation, even when the warm-up left nothing cached:
# one max_split_size-class segment of slack keeps a step's largest temporary allocatable.
MIN_FRAGMENTATION_BUFFER = 64 * MiB


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block across all layers (of one rank's shard of the model)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        # keys and values, every layer: (2, num_layers, block_size, num_kv_heads, head_dim)
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * (self.dtype_bytes)
        )


def fragmentation_buffer(measured: int, requested: int | str) -> int:
    """`requested` is "auto" (measured x safety factor, floored) or a byte count."""
    if requested == "auto":
        return max(int(measured * FRAGMENTATION_SAFETY_FACTOR), MIN_FRAGMENTATION_BUFFER)
    assert isinstance(requested, int) and requested >= 0, f"bad buffer size {requested!r}"
    return requested


def kv_cache_bytes(
    allowed: int, weights: int, peak_activations: int, non_torch: int, buffer: int
) -> int:
    """What `allowed` leaves for the KV cache once the other terms are paid (may be negative)."""
    return allowed - weights - peak_activations - non_torch - buffer


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` tokens."""
    return -(-num_tokens // block_size)


# The host KV tier's copies pass through a staging buffer on the GPU of about this many bytes
# (whole blocks, at least one): large enough that a step's copies take a few launches, small
# beside the KV cache. Its blocks come out of the KV cache's budget (`kv_cache_blocks`).
KV_OFFLOAD_STAGING_BYTES = 64 * MiB


def kv_offload_staging_blocks(bytes_per_block: int) -> int:
    """Blocks the host tier's GPU staging buffer holds: two equal halves, for the loads and
    the stores, which run side by side."""
    return 2 * max(1, KV_OFFLOAD_STAGING_BYTES // 2 // bytes_per_block)


def kv_cache_blocks(num_budget_blocks: int, bytes_per_block: int, has_host_tier: bool) -> int:
    """The KV pool's blocks out of what the budget holds: less the host tier's staging."""
    if not has_host_tier:
        return num_budget_blocks
    return num_budget_blocks - kv_offload_staging_blocks(bytes_per_block)
