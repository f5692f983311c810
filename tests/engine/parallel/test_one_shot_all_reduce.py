"""The one-shot all-reduce on two and four GPUs, set up through the group as the engine sets it
up: it sums what NCCL sums, eagerly and from a CUDA graph that holds several all-reduces back to
back over the one buffer, replayed with new inputs (a rank that refilled its buffer while a peer
still read it would give a wrong sum here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagekeeper_engine.distributed.group import TensorParallelGroup, join_rendezvous
from tests.engine.parallel.ranks import GPU_RANK_COUNTS, spawn_ranks

HIDDEN = 256
ROWS = (1, 3, 64, 512)
EXACT_BF16_INTEGER = 256  # 2**8: bf16 holds every integer up to it exactly
RESULT_TIMEOUT_S = 300.0


def _integers(
    rows: int, size: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Integers small enough that every partial sum over `size` ranks stays within bf16's exact
    integers (|n| <= 256), so both paths agree bit for bit whatever order they add in."""
    bound = EXACT_BF16_INTEGER // size
    values = torch.randint(-bound, bound + 1, (rows, HIDDEN), generator=generator, device=device)
    return values.to(torch.bfloat16)


def _rank(rank: int, size: int, port: int, results: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = TensorParallelGroup.initialize(rank, size, join_rendezvous(port, size), device)
    choice = group.enable_one_shot(2 * max(ROWS) * HIDDEN, HIDDEN, torch.bfloat16)
    found: dict[str, Any] = {"off_reason": choice.off_reason}
    one_shot = group.one_shot
    if one_shot is None:
        results.put((rank, found))
        return
    generator = torch.Generator(device=device).manual_seed(rank)

    def nccl_sums(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        sums = [x.clone() for x in xs]
        for x in sums:
            dist.all_reduce(x, group=group.device_group)
        return sums

    inputs = [_integers(rows, size, generator, device) for rows in ROWS]
    eager = [x.clone() for x in inputs]
    for x in eager:
        one_shot.all_reduce_(x)
    found["eager_equal"] = all(map(torch.equal, eager, nccl_sums(inputs)))

    static = [x.clone() for x in inputs]  # the addresses the graph reads and writes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in static:
            one_shot.all_reduce_(x)
    replays = []
    for _ in range(3):
        fresh = [_integers(rows, size, generator, device) for rows in ROWS]
        for x, new in zip(static, fresh, strict=True):
            x.copy_(new)
        graph.replay()
        replays.append(all(map(torch.equal, static, nccl_sums(fresh))))
    torch.cuda.synchronize()
    found["replays_equal"] = replays
    results.put((rank, found))
    # no destroy_process_group: with a graph that captured the communicator it can hang


@pytest.mark.gpu
@pytest.mark.parametrize("size", GPU_RANK_COUNTS)
def test_one_shot_sums_what_nccl_sums_on_gpus(size: int) -> None:
    found = dict(spawn_ranks(_rank, size, (), size, RESULT_TIMEOUT_S))
    pairs = [(a, b) for a in range(size) for b in range(size) if a != b]
    if not all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs):
        # Without peer access the path stays off on every rank, with the reason.
        assert all(found[rank]["off_reason"] is not None for rank in range(size))
        return
    for rank in range(size):
        assert found[rank]["off_reason"] is None, found[rank]["off_reason"]
        assert found[rank]["eager_equal"] is True, f"rank {rank}: {found[rank]}"
        assert found[rank]["replays_equal"] == [True, True, True], f"rank {rank}: {found[rank]}"
