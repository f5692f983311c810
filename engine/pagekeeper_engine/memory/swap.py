"""Block copies between the device KV pool and the pinned host swap pool.

Both pools are shaped (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim). The fast
path gathers the blocks into one tensor and copies it across in one transfer; that gather needs
device memory. When the device has none to give (the moment swapping is most needed), the blocks
go one (layer, k/v, block) slice at a time: each slice is contiguous in both pools, so the copy
allocates nothing on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def copy_blocks(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    src_to_dst: Sequence[tuple[int, int]],
    device: torch.device,
) -> bool:
    """Copy blocks `src -> dst` between pools; True when the device ran out of memory and the
    allocation-free path did the copy."""
    if not src_to_dst:
        return False
    try:
        _copy_gathered(src_pool, dst_pool, src_to_dst)
        return False
    except torch.OutOfMemoryError as exc:
        logger.warning("swap of %d blocks ran out of device memory: %s", len(src_to_dst), exc)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for src_block, dst_block in src_to_dst:
        for layer in range(src_pool.shape[0]):
            for kv in range(2):
                dst_pool[layer, kv, dst_block].copy_(src_pool[layer, kv, src_block])
    return True


def _copy_gathered(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_to_dst: Sequence[tuple[int, int]]
) -> None:
    if src_pool.element_size() == 1:  # FP8 blocks move as their bytes (indexing needs no FP8)
        src_pool, dst_pool = src_pool.view(torch.uint8), dst_pool.view(torch.uint8)
    src = torch.tensor([s for s, _ in src_to_dst], dtype=torch.int64, device=src_pool.device)
    dst = torch.tensor([d for _, d in src_to_dst], dtype=torch.int64, device=dst_pool.device)
    moved = src_pool[:, :, src]  # (L, 2, n, block_size, kv_heads, head_dim), on src's device
    dst_pool[:, :, dst] = moved.to(dst_pool.device)
