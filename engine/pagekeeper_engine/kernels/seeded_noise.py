# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The Exp(1) draws of seeded rows, every row in one launch.

Row r's draw at column c is E = -log(1 - U), U = `tl.rand(key_r, col_offset + c)`: lane 0 of
Philox4x32-10 under the row's key at the counter of the column's index in the whole vocabulary
(`reference.keyed_uniforms_ref`). A seeded request's key comes from its seed and its number of
output tokens (`runner/pick.seeded_key`), so its draws depend neither on its row, nor on the
batch, nor on which rank's vocabulary shard the columns are: one GPU and every tensor-parallel
size race over the same draws. U < 1, so E is finite and >= 0 (the race reads max(E,
NOISE_FLOOR)). One launch replaces a generator and a launch per seeded row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import check_device

BLOCK = 1024  # columns a program draws


@triton.jit(do_not_specialize=("noise_ptr", "rows_keys_ptr", "num_seeded"))
def _seeded_noise_kernel(
    noise_ptr,  # (R, >= width) fp32
    rows_keys_ptr,  # (2, num_seeded) int64: each seeded row's index in noise, then its key
    num_seeded,
    noise_row_stride,
    col_offset,
    width,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_keys_ptr + i)
    key = tl.load(rows_keys_ptr + num_seeded + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = tl.rand(key, cols.to(tl.int64) + col_offset)
    draw = -tl.log(1.0 - uniform)
    tl.store(noise_ptr + row * noise_row_stride + cols, draw, mask=cols < width)


def seeded_noise(
    noise: torch.Tensor,  # (R, >= width) fp32, written in place
    rows: list[int],  # the seeded rows of `noise`
    keys: list[int],  # their Philox keys, in [0, 2**63)
    col_offset: int,  # column 0's index in the whole vocabulary
    width: int,  # the columns drawn
) -> None:
    """Fill columns 0..width-1 of each of `rows` of `noise` with that row's keyed draws."""
    assert noise.dtype == torch.float32 and noise.dim() == 2, f"noise {noise.dtype} {noise.dim()}"
    assert noise.stride(1) == 1 and 0 <= width <= noise.shape[1], "noise rows must hold `width`"
    assert len(rows) == len(keys), "a key for each seeded row"
    assert all(0 <= r < noise.shape[0] for r in rows), f"rows {rows} outside {noise.shape[0]}"
    assert all(0 <= k < 2**63 for k in keys), "keys must fit int64"
    assert col_offset >= 0, f"col_offset {col_offset}"
    if not rows or width == 0:
        return
    check_device("noise", noise, noise.device)
    rows_keys = torch.tensor([rows, keys], dtype=torch.int64).to(noise.device, non_blocking=True)
    _seeded_noise_kernel[(len(rows), triton.cdiv(width, BLOCK))](
        noise, rows_keys, len(rows), noise.stride(0), col_offset, width, BLOCK=BLOCK
    )
