"""Triton kernels over the paged KV cache, and the input checks their launchers share.

Kernel modules (`kv_write`, `paged_decode`, `paged_prefill`) import triton; this package's
`__init__` does not, so `TRITON_INTERPRET=1` can still be set after importing it. Each launcher
checks its inputs with `assert`s whose messages name the argument: a violation is a bug in the
caller, never a user error.
"""

from __future__ import annotations

import os

import torch

BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The KV cache may also hold FP8 (e4m3) values of half-precision keys and values: kernels load
# them and compute in the query's dtype.
FP8_CACHE_DTYPE = torch.float8_e4m3fn
CACHE_DTYPES = (*SUPPORTED_DTYPES, FP8_CACHE_DTYPE)
# FP8 projection weights (`model/fp8.py`): the GEMV reads them with a scale per row.
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
# The sampler's race reads its Exp(1) draws as max(E, NOISE_FLOOR): an exact 0 draw would make
# -log E = +inf, and +inf + -inf = NaN on a masked token. The kernel and its torch reference
# (`runner/sampler.py`) take the same floor.
NOISE_FLOOR = torch.finfo(torch.float32).tiny


# Triton compiles a variant of a kernel for each new combination of "pointer is 16-byte aligned" and
# "integer is 1 / a multiple of 16" among its arguments. The per-step metadata (block tables,
# sequence lengths, slot mappings, positions) is sliced from staging buffers at offsets that change
# with the batch, and the sampler's scratch with the row count, so those flags changed from step to
# step and compiled new variants while serving: 13 compiles, 4.9 s inside the first W-nano run after
# a start with an empty cache (docs/benchmarks-archive.md, "no compiles while serving"). The kernels
# read these arguments a few scalars per program, so the hints buy nothing: each kernel lists them
# in `do_not_specialize`.


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while the one before it finishes): native
    kernels on Hopper (sm_90) and later."""
    if device.type != "cuda" or is_interpreter():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    assert tensor.device == device, f"{name} is on {tensor.device}, expected {device}"
    # The environment is read only for a CPU tensor: an eager step checks ~30 tensors a layer.
    assert tensor.is_cuda or is_interpreter(), (
        f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    )


def check_like(
    name: str, tensor: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None
) -> None:
    """`tensor` has ref's shape and device, `dtype` (by default ref's), and unit last stride."""
    dtype = ref.dtype if dtype is None else dtype
    assert tensor.shape == ref.shape, f"{name} shape {tuple(tensor.shape)} != {tuple(ref.shape)}"
    assert tensor.dtype == dtype, f"{name} is {tensor.dtype}, expected {dtype}"
    assert tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension"
    check_device(name, tensor, ref.device)


def check_index_tensor(name: str, tensor: torch.Tensor, ndim: int, dtype: torch.dtype) -> None:
    assert tensor.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}"
    assert tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}"
    assert tensor.stride(-1) == 1, f"{name} must be contiguous in its last dimension"


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a layer's cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    assert k_cache.dim() == 4, (
        "k_cache must be (num_blocks, block_size, num_kv_heads, head_dim), "
        f"got shape {tuple(k_cache.shape)}"
    )
    assert v_cache.shape == k_cache.shape, (
        f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
    )
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    assert k_cache.dtype in CACHE_DTYPES, f"cache dtype {k_cache.dtype} is not supported"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k_cache.device == v_cache.device, "k_cache and v_cache are on different devices"
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    assert block_size in BLOCK_SIZES, f"block size {block_size} is not one of {BLOCK_SIZES}"
    # A power of two >= 16 keeps every tile load unmasked along head_dim and fits tl.dot.
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim {head_dim} must be a power of 2 >= 16"
    )
    return num_blocks, block_size, num_kv_heads, head_dim


def check_heads(
    name: str, tensor: torch.Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Check a (tokens, heads, head_dim) tensor against the cache; returns its number of heads.
    An FP8 cache takes half-precision tensors; any other cache, tensors of its own dtype."""
    assert tensor.dim() == 3, f"{name} must be (tokens, heads, head_dim), got {tuple(tensor.shape)}"
    if dtype == FP8_CACHE_DTYPE:
        assert tensor.dtype in (torch.float16, torch.bfloat16), (
            f"{name} is {tensor.dtype}; an FP8 cache takes float16 or bfloat16"
        )
    else:
        assert tensor.dtype == dtype, f"{name} is {tensor.dtype} but the cache is {dtype}"
    assert tensor.shape[2] == head_dim, f"{name} head_dim {tensor.shape[2]} != cache's {head_dim}"
    assert tensor.stride(2) == 1, f"{name} must be contiguous in head_dim"
    num_heads = int(tensor.shape[1])
    assert num_heads % num_kv_heads == 0, (
        f"{name} has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads"
    )
    return num_heads


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots run in full precision; half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
