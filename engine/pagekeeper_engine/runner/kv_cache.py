"""The KV cache's element type and the shape of one block, as the runner allocates them."""

from __future__ import annotations

import torch

from pagekeeper_engine.attention.base import UNSCALED, KVScales
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.memory.budget import KVLayout
from pagekeeper_engine.model.hf_config import ModelConfig


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
