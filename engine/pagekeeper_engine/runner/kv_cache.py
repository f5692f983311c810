"""The KV cache's element type, the shape of one block, and the pools the runner allocates:
the device pool every layer's cache is a view of, and the host pool blocks are swapped to."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekeeper_engine.attention.base import UNSCALED, KVScales
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.memory.budget import KVLayout
from pagekeeper_engine.memory.swap import copy_blocks
from pagekeeper_engine.model.hf_config import ModelConfig


def pool_shape(model_config: ModelConfig, block_size: int, num_blocks: int) -> tuple[int, ...]:
    """One pool for all layers: (num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim), keys at index 0 and values at 1 of the second axis."""
    cfg = model_config
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


class KVPools:
    """The device pool of `num_gpu_blocks` and the host swap pool of `num_cpu_blocks` (pinned
    where the device is a GPU), both zero-filled so that a kernel reading a whole block never
    meets NaN garbage; `swap` copies whole blocks between them."""

    def __init__(
        self,
        model_config: ModelConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.device_pool = torch.zeros(
            pool_shape(model_config, block_size, num_gpu_blocks), dtype=dtype, device=device
        )
        self.host_pool = torch.zeros(
            pool_shape(model_config, block_size, num_cpu_blocks),
            dtype=dtype,
            pin_memory=device.type == "cuda",
        )
        self.num_swap_ooms = 0  # swaps that ran out of device memory and fell back to a slow copy

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_cache, v_cache) views of the device pool."""
        return [(layer[0], layer[1]) for layer in self.device_pool]

    def swap(self, src_to_dst: Sequence[tuple[int, int]], *, to_cpu: bool) -> None:
        """Copy whole blocks (every layer, keys and values) between the device and host pools;
        `num_swap_ooms` counts copies that found no device memory (see `memory.swap`)."""
        if not src_to_dst:
            return
        src_pool, dst_pool = (
            (self.device_pool, self.host_pool) if to_cpu else (self.host_pool, self.device_pool)
        )
        assert max(d for _, d in src_to_dst) < dst_pool.shape[2], "swap target beyond its pool"
        if copy_blocks(src_pool, dst_pool, src_to_dst, self.device_pool.device):
            self.num_swap_ooms += 1


def resolve_kv_cache_dtype(
    config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype: the model's, or FP8 (e4m3) where asked and the GPU has it."""
    if not config.is_fp8_kv_cache:
        return dtype
    if device.type != "cuda":
        raise ValueError("--kv-cache-dtype fp8 needs a CUDA GPU; the CPU has no FP8 path")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"--kv-cache-dtype fp8 needs FP8 support (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--kv-cache-dtype fp8 stores bfloat16 or float16 values, not {dtype}")
    return torch.float8_e4m3fn


def kv_layout(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
    """One block across every layer of (this rank's shard of) the model."""
    cfg = model_config
    return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype.itemsize)


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer, keys and values."""
    return kv_layout(model_config, block_size, dtype).bytes_per_block


def describe_kv_scales(scales: list[KVScales], cache_dtype: torch.dtype) -> str:
    """One log line on the checkpoint's KV scales and whether the cache uses them."""
    given = [s for s in scales if s != UNSCALED]
    if not given:
        if cache_dtype == torch.float8_e4m3fn:
            return "FP8 KV cache without checkpoint scales: values stored as they are (scale 1.0)"
        return "KV cache unscaled"
    k = [s.k for s in scales]
    v = [s.v for s in scales]
    where = f"k_scale {min(k):.4g}..{max(k):.4g}, v_scale {min(v):.4g}..{max(v):.4g}"
    if cache_dtype != torch.float8_e4m3fn:
        return f"the checkpoint's KV scales ({where}) are unused: the cache is {cache_dtype}"
    return f"FP8 KV cache with the checkpoint's scales of {len(given)} layers: {where}"
