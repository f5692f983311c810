"""Random paged KV caches with scattered block tables, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass
class PagedCache:
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (S, max_blocks_per_seq) int32, padded with 0
    seq_lens: torch.Tensor  # (S,) int32


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    num_spare_blocks: int = 3,
) -> PagedCache:
    """Every sequence gets randomly chosen, non-adjacent blocks; spare blocks hold noise too, so
    a kernel that reads a wrong block gets a wrong answer rather than zeros."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    max_blocks = max(blocks_per_seq) + 2  # padded columns, as the runner pads them
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    taken = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = order[taken : taken + count]
        taken += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedCache(
        k_cache=random_tensor(shape, dtype, device, gen),
        v_cache=random_tensor(shape, dtype, device, gen),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, NaN-propagating so NaN never passes a `<` check."""
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm())


# FP8 kernels run natively only: the interpreter narrows to FP8 without carrying a rounding into
# the exponent (0.498 -> 0.25), and the e4m3 type needs compute capability 8.9.
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9 or newer)",
)

# Tolerances on relative error, by dtype (fp32 through the interpreter is exact arithmetic
# up to summation order; the half types round p before the second dot).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
