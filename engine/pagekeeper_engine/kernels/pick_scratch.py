"""The token pick's scratch: its outputs and per-chunk partials, allocated once (torch only).

Each row's vocabulary is read in chunks of `block_v` entries; a chunk's partials are PLANES
(rows, chunks) planes: the max of the raw logits, the sum of exp(raw - max), the best race
score, the raw logit at the best index (fp32), and the best index over the whole vocabulary
(int32, stored in the same fp32 memory). `kernels/sampling.py` writes and merges them on GPUs;
`runner/shard_pick.py` does the same in torch on the CPU.
"""

from __future__ import annotations

import math

import torch

BLOCK_V = 2048
PLANES = 5


class PickScratch:
    """The pick's outputs and per-chunk partials for up to `max_rows` rows of a `vocab_size`
    vocabulary (a rank's shard width under tensor parallelism), allocated once: a step's pick
    works in their leading rows and allocates nothing. With `ranks` > 1 it also holds every
    rank's partials, gathered. A step's ids and packed results stay valid until the next pick
    over the same scratch is enqueued (stream order)."""

    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        device: torch.device | str,
        block_v: int = BLOCK_V,
        ranks: int = 1,
    ) -> None:
        assert ranks >= 1, f"ranks {ranks} must be at least 1"
        assert block_v >= 16 and block_v & (block_v - 1) == 0, f"block_v {block_v} not a power of 2"
        self.max_rows = max_rows
        self.block_v = block_v
        self.ranks = ranks
        self.num_chunks = math.ceil(vocab_size / block_v)
        self.token_ids = torch.empty(max_rows, dtype=torch.int64, device=device)
        self.packed = torch.empty(2 * max_rows, dtype=torch.float64, device=device)
        size = PLANES * max_rows * self.num_chunks
        self.parts = torch.empty(size, dtype=torch.float32, device=device)
        self.gathered = torch.empty(
            size * ranks if ranks > 1 else 0, dtype=torch.float32, device=device
        )
        # One rank's one-launch pick counts each row's chunks in here (zero between launches).
        self.counters = torch.zeros(max_rows if ranks == 1 else 0, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        planes = (self.token_ids, self.packed, self.parts, self.gathered, self.counters)
        return sum(t.nbytes for t in planes)

    def views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_ids (N,), packed (2, N) contiguous and this rank's partials (PLANES, N, C)
        fp32 for N = `num_rows`."""
        assert num_rows <= self.max_rows, f"{num_rows} rows exceed the scratch's {self.max_rows}"
        size = PLANES * num_rows * self.num_chunks
        return (
            self.token_ids[:num_rows],
            self.packed[: 2 * num_rows].view(2, num_rows),
            self.parts[:size].view(PLANES, num_rows, self.num_chunks),
        )

    def gathered_view(self, num_rows: int) -> torch.Tensor:
        """(ranks, PLANES, N, C): where every rank's partials of N rows are gathered."""
        assert self.ranks > 1, "a one-rank scratch combines its own partials"
        assert num_rows <= self.max_rows, f"{num_rows} rows exceed the scratch's {self.max_rows}"
        size = self.ranks * PLANES * num_rows * self.num_chunks
        return self.gathered[:size].view(self.ranks, PLANES, num_rows, self.num_chunks)
