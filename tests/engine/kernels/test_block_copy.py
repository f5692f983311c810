"""`kernels.block_copy` against its torch reference: blocks gathered from the pool's layout into
block-major staging and scattered back, at irregular ids, for 2-byte and FP8 (1-byte) values."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.block_copy import as_words, gather_blocks, scatter_blocks
from pagekeeper_engine.kernels.reference import gather_blocks_ref, scatter_blocks_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.bfloat16, (3, 2, 9, 4, 2, 16)),  # (layers, k/v, blocks, block_size, heads, dim)
        (torch.float8_e4m3fn, (2, 2, 7, 8, 1, 6)),  # 48 bytes a chunk: int32 words
        (torch.float8_e4m3fn, (2, 2, 5, 3, 1, 5)),  # 15 bytes a chunk: single bytes
    ],
)
def test_gather_and_scatter_match_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    pool = torch.randn(shape, device=DEVICE).to(dtype)
    words = as_words(pool)
    ids = torch.tensor([4, 0, 2, 3], dtype=torch.int64, device=DEVICE)
    staging = torch.zeros((6, *words.shape[::2]), dtype=words.dtype, device=DEVICE)
    gather_blocks(words, ids, staging)
    assert torch.equal(staging[:4], gather_blocks_ref(words, ids))
    assert not staging[4:].any()  # only the first len(ids) rows are written

    target = torch.zeros_like(pool)
    target_words = as_words(target)
    scatter_blocks(staging, ids, target_words)
    expected = torch.zeros_like(target_words)
    scatter_blocks_ref(staging[:4], ids, expected)
    assert torch.equal(target_words, expected)
    untouched = [b for b in range(shape[2]) if b not in ids.tolist()]
    assert not target_words[:, untouched].any()
    assert torch.equal(target_words[:, ids], words[:, ids])  # the round trip


def test_the_launcher_names_a_bad_argument() -> None:
    words = as_words(torch.zeros((1, 2, 4, 2, 1, 4), dtype=torch.bfloat16, device=DEVICE))
    staging = torch.zeros((2, 2, 4), dtype=words.dtype, device=DEVICE)
    too_many = torch.arange(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="3 blocks do not fit 2 staged"):
        gather_blocks(words, too_many, staging)
    with pytest.raises(AssertionError, match="block_ids: int64"):
        gather_blocks(words, too_many[:2].int(), staging)
