"""The one-shot peer reduce kernel at one rank, both ways: the sum, the fused residual add and
norm, programs over several rows, the launch count and the pad left clear, and the launcher's
checks; and one rank of two or four alone, with its peers' part already done (their rows pushed
into its receiving regions, or their signals for both of its meetings in its pad), with the
exact values it leaves in every rank's buffer and pad. Several ranks cannot run at once in one
process: Triton's interpreter runs one launch at a time, and a rank's launch waits for its
peers. So the ranks reaching each other are tested on two and four GPUs, in bf16 against NCCL
(`tests/engine/parallel`). Sums here are checked in fp32 and fp16 (the interpreter rounds fp32
to bf16 its own way)."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.kernels.peer_reduce import (
    LAUNCH_COUNT_WORDS,
    PeerBuffers,
    buffer_elements,
    peer_reduce,
    sentinel_bits,
)
from tests.engine.kernels.hopper_compile import compile_for_hopper

EPS = 1e-6
# A rank waiting for peers that never come spins forever: fail the test instead of waiting.
pytestmark = pytest.mark.timeout(120)
WAYS = ("push", "pull")


class Rank:
    """A rank's buffer (its receiving regions cleared) and signal pad, as `PeerBuffers` maps
    them, among `world` such ranks."""

    def __init__(
        self, world: int, staging: int, region: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.buffer = torch.zeros(
            buffer_elements(world, staging, region), dtype=dtype, device=device
        )
        PeerBuffers.clear(self.buffer, staging)
        self.pad = torch.zeros(64 * world, dtype=torch.int32, device=device)
        self.staging, self.region, self.world = staging, region, world

    def received(self, slot: int, k: int) -> torch.Tensor:
        """The receiving region in `slot` for the rows of the peer k ranks back."""
        start = self.staging + (slot * (self.world - 1) + self.world - 1 - k) * self.region
        return self.buffer[start : start + self.region]


def _peers(ranks: list[Rank], rank: int, max_programs: int) -> PeerBuffers:
    device = ranks[0].buffer.device
    own = ranks[rank]
    return PeerBuffers(
        own.buffer,
        torch.tensor([r.buffer.data_ptr() for r in ranks], device=device),
        torch.tensor([r.pad.data_ptr() for r in ranks], device=device),
        torch.zeros(LAUNCH_COUNT_WORDS, dtype=torch.int32, device=device),
        rank,
        len(ranks),
        own.staging,
        own.region,
        max_programs,
    )


def _one_rank(
    staging: int, max_programs: int, device: torch.device, dtype: torch.dtype
) -> tuple[PeerBuffers, Rank]:
    """A rank of one: a staging region only, at its own address."""
    rank = Rank(1, staging, staging, device, dtype)
    return _peers([rank], 0, max_programs), rank


def _is_sentinel(x: torch.Tensor) -> torch.Tensor:
    bits_dtype, sentinel = sentinel_bits(x.dtype)
    return x.view(bits_dtype) == sentinel


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("rows", "dim", "max_programs"), [(1, 64, 64), (7, 48, 3), (5, 96, 8)])
def test_the_sum_of_one_rank_is_its_rows_and_pushes_are_counted(
    way: str,
    rows: int,
    dim: int,
    max_programs: int,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    # 3 programs for 7 rows: programs take several rows each.
    peers, rank = _one_rank(rows * dim + 5, max_programs, device, torch.float32)
    out = torch.full((rows, dim), float("nan"), device=device)
    for launch in range(3):  # over the same pad: each meeting leaves it as it found it
        partial = torch.randn(rows, dim, generator=generator, device=device)
        peers.staged(rows, dim).copy_(partial)
        peer_reduce(peers, rows, dim, push=way == "push", out=out)
        assert torch.equal(out, partial)
        # The push launches so far, and no program of the last one left counted as finished.
        assert peers.counts.tolist() == [launch + 1 if way == "push" else 0, 0]
        assert int(rank.pad.abs().sum()) == 0


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fused_norm_adds_the_sum_into_the_residual_and_norms_it(
    way: str, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    rows, dim = 5, 96  # dim not a power of two: the masked tail of the row
    peers, _ = _one_rank(rows * dim, 2, device, dtype)
    partial = torch.randn(rows, dim, generator=generator, device=device).to(dtype)
    peers.staged(rows, dim).copy_(partial)
    residual = torch.randn(rows, dim, generator=generator, device=device).to(dtype)
    weight = torch.randn(dim, generator=generator, device=device).to(dtype)
    expected_residual = (partial.float() + residual.float()).to(dtype)
    x = expected_residual.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    expected = (weight.float() * normed.float()).to(dtype)
    out = torch.empty(rows, dim, device=device, dtype=dtype)
    push = way == "push"
    peer_reduce(peers, rows, dim, push=push, out=out, residual=residual, weight=weight, eps=EPS)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _parts(
    world: int, rows: int, dim: int, generator: torch.Generator, device: torch.device
) -> list[torch.Tensor]:
    return [torch.randn(rows, dim, generator=generator, device=device).half() for _ in range(world)]


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(parts[0].shape, device=parts[0].device)
    for part in parts:  # rank order, in fp32
        total += part.float()
    return total.to(parts[0].dtype)


@pytest.mark.parametrize(("world", "rank", "launches"), [(2, 0, 1), (2, 1, 2), (4, 2, 3)])
def test_a_rank_pushes_its_rows_to_every_peer_and_sums_what_they_pushed(
    world: int, rank: int, launches: int, device: torch.device, generator: torch.Generator
) -> None:
    rows, dim, programs = 5, 32, 3  # programs take several rows each
    # The receiving regions smaller than the staging region, and their tails beyond the rows
    # left as sentinels.
    ranks = [
        Rank(world, 2 * rows * dim, rows * dim + 7, device, torch.float16) for _ in range(world)
    ]
    peers = _peers(ranks, rank, programs)
    peers.counts[0] = launches - 1  # this launch's slot: push launches alternate
    slot = (launches - 1) % 2
    parts = _parts(world, rows, dim, generator, device)
    parts[rank][0, :4] = -0.0  # its own -0.0s: pushed as +0.0, never as the sentinel
    peers.staged(rows, dim).copy_(parts[rank])
    for source in range(world):  # every peer's push has landed already
        if source != rank:
            ranks[rank].received(slot, (rank - source) % world)[: rows * dim] = parts[
                source
            ].flatten()
    out = torch.empty(rows, dim, device=device, dtype=torch.float16)
    peer_reduce(peers, rows, dim, push=True, out=out)

    assert torch.equal(out, _rank_order_sum(parts))
    assert peers.counts.tolist() == [launches, 0]
    pushed = parts[rank].flatten().clone()
    pushed[:4] = 0.0
    for peer in range(world):
        for other_slot in (0, 1):
            for k in range(1, world):
                received = ranks[peer].received(other_slot, k)
                if peer != rank and other_slot == slot and (peer - rank) % world == k:
                    # The peer's region for this rank holds its rows, +0.0 for -0.0, bit for bit.
                    assert torch.equal(received[: rows * dim].view(torch.int16),
                                       pushed.view(torch.int16)), f"rank {peer}"  # fmt: skip
                    assert bool(_is_sentinel(received[rows * dim :]).all())
                else:  # every other region: sentinels, its own ones written back after the sum
                    assert bool(_is_sentinel(received).all()), f"rank {peer} {other_slot} {k}"
        assert int(ranks[peer].pad.abs().sum()) == 0, "a push touches no pad"


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_a_pulling_rank_adds_one_to_its_word_in_every_pad_each_meeting_and_takes_its_peers(
    world: int, rank: int, device: torch.device, generator: torch.Generator
) -> None:
    rows, dim, programs = 5, 32, 3  # programs take several rows: two meetings each still
    ranks = [Rank(world, rows * dim, 8, device, torch.float16) for _ in range(world)]
    peers = _peers(ranks, rank, programs)
    parts = _parts(world, rows, dim, generator, device)
    for other, part in zip(ranks, parts, strict=True):
        other.buffer[: rows * dim] = part.flatten()
    # Word p * W + q of this rank's pad counts rank q's arrivals at program p's meetings.
    words = ranks[rank].pad[: programs * world].view(programs, world)
    words[:, [q for q in range(world) if q != rank]] = 2  # every peer has reached both
    out = torch.empty(rows, dim, device=device, dtype=torch.float16)
    peer_reduce(peers, rows, dim, push=False, out=out)

    assert torch.equal(out, _rank_order_sum(parts))
    assert int(ranks[rank].pad.abs().sum()) == 0, "its own words taken back to zero"
    assert peers.counts.tolist() == [0, 0], "a pull is not counted"
    for peer in range(world):
        if peer != rank:  # the peers' pads hold this rank's two arrivals, and nothing else
            expected = torch.zeros(64, world, dtype=torch.int32, device=device)
            expected[:programs, rank] = 2
            assert torch.equal(ranks[peer].pad.view(64, world), expected), f"rank {peer}"
        assert bool(_is_sentinel(ranks[peer].buffer[rows * dim :]).all()), "no region written"


@pytest.mark.parametrize("way", WAYS)
def test_each_peer_s_rows_are_taken_from_its_own_place_and_summed_in_rank_order(
    way: str, device: torch.device
) -> None:
    # fp32 keeps 2**-14 beside 0 but not beside 65,504: in rank order 0 + 65,504 - 65,504 +
    # 2**-14 = 2**-14, while ranks 1 and 3 swapped give 0 + 2**-14 - 65,504 + 65,504 = 0. A
    # rank that read a peer's rows from another peer's place would sum in another order.
    world, rank, dim = 4, 2, 16
    values = (0.0, 65504.0, -65504.0, 2.0**-14)
    ranks = [Rank(world, dim, dim, device, torch.float16) for _ in range(world)]
    peers = _peers(ranks, rank, 1)
    parts = [torch.full((1, dim), v, device=device, dtype=torch.float16) for v in values]
    peers.staged(1, dim).copy_(parts[rank])
    for source in range(world):
        if source != rank and way == "push":  # slot 0: the first push launch's
            ranks[rank].received(0, (rank - source) % world)[:dim] = parts[source].flatten()
        if source != rank and way == "pull":  # staged, and at both of this rank's meetings
            ranks[source].buffer[:dim] = parts[source].flatten()
            ranks[rank].pad[source] = 2
    out = torch.empty(1, dim, device=device, dtype=torch.float16)
    peer_reduce(peers, 1, dim, push=way == "push", out=out)
    assert out.flatten().tolist() == [2.0**-14] * dim


def test_the_kernel_compiles_for_hopper() -> None:
    # The interpreter runs what the compiler refuses; on a GPU the launch compiles anyway.
    assert compile_for_hopper("peer_reduce") == ["compiled", "1", "2", "4"]


def test_the_launcher_names_what_is_wrong(device: torch.device) -> None:
    peers, _ = _one_rank(64, 8, device, torch.float32)
    with pytest.raises(AssertionError, match="out shape"):
        peer_reduce(peers, 2, 16, push=False, out=torch.empty(2, 8, device=device))
    with pytest.raises(AssertionError, match="exceeds the buffer"):
        peer_reduce(peers, 8, 16, push=False, out=torch.empty(8, 16, device=device))
    with pytest.raises(AssertionError, match="residual and weight"):
        out = torch.empty(2, 16, device=device)
        peer_reduce(peers, 2, 16, push=False, out=out, residual=out.clone())
    with pytest.raises(AssertionError, match="out is"):
        half = torch.empty(2, 16, device=device, dtype=torch.float16)
        peer_reduce(peers, 2, 16, push=False, out=half)
    ranks = [Rank(2, 64, 16, device, torch.float32) for _ in range(2)]
    with pytest.raises(AssertionError, match="exceeds the buffer"):  # a receiving region's 16
        peer_reduce(_peers(ranks, 0, 8), 2, 16, push=True, out=torch.empty(2, 16, device=device))
