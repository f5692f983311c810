"""The one-shot peer reduce kernel at one rank, whose programs meet themselves at its signal
pad: the sum, the fused residual add and norm, the pad left clear, programs over several rows,
and the launcher's checks; and one rank of two or four alone, its peers' signals for both of
its meetings already in its pad, with the exact words it leaves in every pad. Several ranks
cannot run at once in one process: Triton's interpreter runs one launch at a time (its program
index is global), and on a GPU a rank's first launch loads the kernel's module while a peer's
launch spins, which waits for it. So the ranks meeting each other are tested on two and four
GPUs, in bf16 against NCCL (`tests/engine/parallel`). Sums here are checked in fp32 and fp16
(the interpreter rounds fp32 to bf16 its own way)."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.peer_reduce import SIGNAL_WORD_BYTES, PeerBuffers, peer_reduce

EPS = 1e-6
# A meeting whose signals never come spins forever: fail the test instead of waiting for it.
pytestmark = pytest.mark.timeout(120)


def _one_rank(
    capacity: int, pad_words: int, device: torch.device, dtype: torch.dtype
) -> tuple[PeerBuffers, torch.Tensor]:
    """A rank of one: its buffer and signal pad, mapped at their own addresses."""
    buffer = torch.zeros(capacity, dtype=dtype, device=device)
    pad = torch.zeros(pad_words, dtype=torch.int32, device=device)
    buffer_ptrs = torch.tensor([buffer.data_ptr()], device=device)
    pad_ptrs = torch.tensor([pad.data_ptr()], device=device)
    max_programs = PeerBuffers.pad_programs(pad_words * SIGNAL_WORD_BYTES, 1)
    return PeerBuffers(buffer, buffer_ptrs, pad_ptrs, 0, 1, max_programs), pad


@pytest.mark.parametrize(("rows", "dim", "pad_words"), [(1, 64, 64), (7, 48, 3), (5, 96, 8)])
def test_the_sum_of_one_rank_is_its_rows_and_the_pad_ends_clear(
    rows: int, dim: int, pad_words: int, device: torch.device, generator: torch.Generator
) -> None:
    # 3 words hold 3 programs: 7 rows make programs take several rows each.
    peers, pad = _one_rank(rows * dim + 5, pad_words, device, torch.float32)
    out = torch.full((rows, dim), float("nan"), device=device)
    for _ in range(3):  # over the same pad: each meeting leaves it as it found it
        partial = torch.randn(rows, dim, generator=generator, device=device)
        peers.staged(rows, dim).copy_(partial)
        peer_reduce(peers, rows, dim, out=out)
        assert torch.equal(out, partial)
        assert int(pad.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fused_norm_adds_the_sum_into_the_residual_and_norms_it(
    dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    rows, dim = 5, 96  # dim not a power of two: the masked tail of the row
    peers, pad = _one_rank(rows * dim, 2, device, dtype)
    partial = torch.randn(rows, dim, generator=generator, device=device).to(dtype)
    peers.staged(rows, dim).copy_(partial)
    residual = torch.randn(rows, dim, generator=generator, device=device).to(dtype)
    weight = torch.randn(dim, generator=generator, device=device).to(dtype)
    expected_residual = (partial.float() + residual.float()).to(dtype)
    x = expected_residual.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    expected = (weight.float() * normed.float()).to(dtype)
    out = torch.empty(rows, dim, device=device, dtype=dtype)
    peer_reduce(peers, rows, dim, out=out, residual=residual, weight=weight, eps=EPS)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert int(pad.abs().sum()) == 0


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_a_rank_adds_one_to_its_word_in_every_pad_each_meeting_and_takes_its_peers(
    world: int, rank: int, device: torch.device, generator: torch.Generator
) -> None:
    rows, dim, programs = 5, 32, 3  # programs take several rows: two meetings each still
    pad_words = programs * world
    buffers = [torch.zeros(rows * dim, device=device) for _ in range(world)]
    pads = [torch.zeros(pad_words, dtype=torch.int32, device=device) for _ in range(world)]
    peers = PeerBuffers(
        buffers[rank],
        torch.tensor([b.data_ptr() for b in buffers], device=device),
        torch.tensor([p.data_ptr() for p in pads], device=device),
        rank,
        world,
        programs,
    )
    parts = [torch.randn(rows, dim, generator=generator, device=device) for _ in range(world)]
    for buffer, part in zip(buffers, parts, strict=True):
        buffer.copy_(part.flatten())
    # Word p * W + q of this rank's pad counts rank q's arrivals at program p's meetings.
    words = pads[rank].view(programs, world)
    words[:, [q for q in range(world) if q != rank]] = 2  # every peer has reached both
    out = torch.empty(rows, dim, device=device)
    peer_reduce(peers, rows, dim, out=out)

    total = torch.zeros(rows, dim, device=device)
    for part in parts:  # rank order
        total += part
    assert torch.equal(out, total)
    assert int(pads[rank].abs().sum()) == 0, "its own words taken back to zero"
    for peer in range(world):
        if peer != rank:  # the peers' pads hold this rank's two arrivals, and nothing else
            expected = torch.zeros(programs, world, dtype=torch.int32, device=device)
            expected[:, rank] = 2
            assert torch.equal(pads[peer].view(programs, world), expected), f"rank {peer}"


def test_the_launcher_names_what_is_wrong(device: torch.device) -> None:
    peers, _ = _one_rank(64, 8, device, torch.float32)
    with pytest.raises(AssertionError, match="out shape"):
        peer_reduce(peers, 2, 16, out=torch.empty(2, 8, device=device))
    with pytest.raises(AssertionError, match="exceeds the buffer"):
        peer_reduce(peers, 8, 16, out=torch.empty(8, 16, device=device))
    with pytest.raises(AssertionError, match="residual and weight"):
        out = torch.empty(2, 16, device=device)
        peer_reduce(peers, 2, 16, out=out, residual=out.clone())
    with pytest.raises(AssertionError, match="out is"):
        peer_reduce(peers, 2, 16, out=torch.empty(2, 16, device=device, dtype=torch.float16))
