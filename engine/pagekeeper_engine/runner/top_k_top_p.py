"""The top-k / top-p cut: everything outside each row's top-k, then its top-p nucleus, at -inf.

Rows are sorted a chunk at a time in a scratch allocated once (`CutScratch`), so the cut's
memory scales with the chunk, never with the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekeeper_engine.core.sampling_params import SamplingParams

# Logits the top-k / top-p cut sorts at once (whole rows, at least one): its scratch and the
# sort's own temporaries (about 75 MiB for 16 rows of a 152k vocabulary) scale with this, never
# with the batch, and stay below the smallest fragmentation buffer of the start-up budget.
CUT_CHUNK_ELEMENTS = 1 << 20


def cut_chunk_rows(max_rows: int, vocab_size: int) -> int:
    return max(1, min(max_rows, CUT_CHUNK_ELEMENTS // max(vocab_size, 1)))


class CutScratch:
    """The top-k / top-p cut's working rows: sorted values and ids, probabilities, mass."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.values = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.ids = torch.empty(num_rows, vocab_size, dtype=torch.int64, device=device)
        self.probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.mass = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.mask = torch.empty(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.ranks = torch.arange(vocab_size, device=device)
        self.row = torch.empty(num_rows, 1, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        planes = (self.values, self.ids, self.probs, self.mass, self.mask, self.ranks, self.row)
        return sum(t.nbytes for t in planes)


def apply_top_k_top_p(
    logits: torch.Tensor,  # (N, V) fp32
    top_k: torch.Tensor,  # (N,) int64; 0 or >= V means no cut
    top_p: torch.Tensor,  # (N,) fp32 in (0, 1]
    *,
    scale: float = 1.0,  # 1 / temperature: top-p measures the mass of softmax(logits * scale)
    out: torch.Tensor | None = None,  # (N, V) fp32, may be `logits` itself; default: a new one
    scratch: CutScratch | None = None,
) -> torch.Tensor:
    """Logits with everything outside each row's top-k, then top-p nucleus, set to -inf.

    Top-p keeps the smallest prefix of tokens (by descending probability, renormalised after the
    top-k cut) whose mass reaches top_p: a token stays when the mass strictly before it is below
    top_p, so the most likely token always stays. Rows are cut `scratch.num_rows` at a time in
    the scratch's rows.
    """
    num_rows, vocab_size = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if scratch is None:
        scratch = CutScratch(cut_chunk_rows(num_rows, vocab_size), vocab_size, logits.device)
    assert out.shape == logits.shape, f"out {tuple(out.shape)} != logits {tuple(logits.shape)}"
    top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    for start in range(0, num_rows, scratch.num_rows):
        end = min(start + scratch.num_rows, num_rows)
        n = end - start
        values, ids = scratch.values[:n], scratch.ids[:n]
        probs, mass, mask, row = (
            scratch.probs[:n],
            scratch.mass[:n],
            scratch.mask[:n],
            scratch.row[:n],
        )
        torch.sort(logits[start:end], dim=-1, descending=True, out=(values, ids))  # (n, V)
        torch.ge(scratch.ranks[None, :], top_k[start:end, None], out=mask)
        values.masked_fill_(mask, float("-inf"))
        # softmax(values * scale) in place: the row's maximum is its first value.
        torch.mul(values[:, :1], scale, out=row)
        torch.mul(values, scale, out=probs)
        probs.sub_(row).exp_()
        torch.sum(probs, dim=-1, keepdim=True, out=row)
        probs.div_(row)
        torch.cumsum(probs, dim=-1, out=mass)
        mass.sub_(probs)  # the mass strictly before each token
        torch.ge(mass, top_p[start:end, None], out=mask)
        values.masked_fill_(mask, float("-inf"))
        out[start:end].fill_(float("-inf")).scatter_(-1, ids, values)
    return out


def cut_top_k_top_p(
    scores: torch.Tensor,  # (N, V) fp32, cut in place
    params: Sequence[SamplingParams],
    scale: float,
    scratch: CutScratch,
) -> None:
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=scores.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=scores.device)
    apply_top_k_top_p(scores, top_k, top_p, scale=scale, out=scores, scratch=scratch)
