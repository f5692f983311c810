"""The FP8 GEMV's read ceiling folds exactly the words each shipped tile reads (checked against
a torch reference; on the CPU through Triton's interpreter), and refuses what it cannot tile."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gemv_tiles import read_tiles
from pagekeeper_engine.kernels.gemv import CANDIDATES, GemvConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def folded(weight: torch.Tensor) -> torch.Tensor:
    words = weight.view(torch.int32)
    out = torch.zeros(words.shape[0], dtype=torch.int32, device=words.device)
    for j in range(words.shape[1]):
        out ^= words[:, j]
    return out


@pytest.mark.parametrize("config", [GemvConfig(8, 512), *CANDIDATES[1:3]], ids=str)
def test_each_row_folds_every_word_of_its_weight(config: GemvConfig) -> None:
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(-128, 128, (16, 4096), dtype=torch.int8, generator=generator)
    weight = raw.to(DEVICE).view(torch.float8_e4m3fn)
    out = torch.empty(16, dtype=torch.int32, device=DEVICE)
    read_tiles(weight, out, config)
    assert torch.equal(out, folded(weight))


def test_a_weight_its_tiles_do_not_divide_is_refused() -> None:
    weight = torch.zeros(12, 1000, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(AssertionError, match="whole tiles"):
        read_tiles(weight, torch.empty(12, dtype=torch.int32, device=DEVICE), GemvConfig(8, 512))
