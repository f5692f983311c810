"""The one-shot all-reduce on two and four GPUs, set up through the group as the engine sets it
up: it sums what NCCL sums, pushed and pulled, eagerly and from a CUDA graph that holds several
all-reduces of both ways back to back over the one buffer, replayed with new inputs (a rank that
refilled its buffer while a peer still read it, or pushed into a slot before a peer had emptied
it, would give a wrong sum here, or wait forever). Its fused form (partial sums written into the
buffer, then the sum added into the residual and normed in one launch) gives what NCCL's sum
and the residual-add norm kernel give, in the same two ways."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagekeeper_engine.distributed.allreduce_choice import OneShotWay
from pagekeeper_engine.distributed.group import TensorParallelGroup, join_rendezvous
from pagekeeper_engine.kernels.rms_norm import rms_norm
from tests.engine.parallel.ranks import GPU_RANK_COUNTS, spawn_ranks

HIDDEN = 256
ROWS = (1, 3, 64, 512)
# The all-reduces of one graph, in order: both ways mixed, an odd number of pushes (a replay
# starts on the other slot from the one before), each way at sizes the other took just before.
CALLS: tuple[tuple[int, OneShotWay], ...] = (
    (1, "push"),
    (3, "pull"),
    (64, "push"),
    (512, "pull"),
    (3, "push"),
    (1, "pull"),
    (64, "pull"),
    (512, "push"),
    (1, "push"),
)
ROWS_OF_CALLS = [rows for rows, _ in CALLS]
EXACT_BF16_INTEGER = 256  # 2**8: bf16 holds every integer up to it exactly
EPS = 1e-6
RESULT_TIMEOUT_S = 300.0


def _integers(
    rows: int, size: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Integers small enough that every partial sum over `size` terms stays within bf16's exact
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

    inputs = [_integers(rows, size, generator, device) for rows, _ in CALLS]
    eager = [x.clone() for x in inputs]
    for x, (_, way) in zip(eager, CALLS, strict=True):
        one_shot.all_reduce_(x, way)
    found["eager_equal"] = all(map(torch.equal, eager, nccl_sums(inputs)))

    static = [x.clone() for x in inputs]  # the addresses the graph reads and writes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, (_, way) in zip(static, CALLS, strict=True):
            one_shot.all_reduce_(x, way)
    replays = []
    for _ in range(3):
        fresh = [_integers(rows, size, generator, device) for rows, _ in CALLS]
        for x, new in zip(static, fresh, strict=True):
            x.copy_(new)
        graph.replay()
        replays.append(all(map(torch.equal, static, nccl_sums(fresh))))
    torch.cuda.synchronize()
    found["replays_equal"] = replays
    found.update(_fused(group, size, generator, device))
    results.put((rank, found))
    # no destroy_process_group: with a graph that captured the communicator it can hang


def _fused(
    group: TensorParallelGroup, size: int, generator: torch.Generator, device: torch.device
) -> dict[str, Any]:
    """The fused sum, residual add and norm against NCCL's sum and the norm kernel: residuals
    exact (integers over size + 1 terms), norms within a bf16 rounding; eagerly, then from a
    graph of every size back to back, replayed with new partial sums."""
    weight = torch.randn(HIDDEN, generator=generator, device=device).to(torch.bfloat16)
    dist.broadcast(weight, src=0, group=group.device_group)  # every rank holds one norm

    def expected(partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        summed = partial.clone()
        dist.all_reduce(summed, group=group.device_group)
        out, new_residual = rms_norm(summed, weight, EPS, residual)
        assert new_residual is not None
        return out, new_residual

    def close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
        (out, residual), (want_out, want_residual) = got, want
        return torch.equal(residual, want_residual) and torch.allclose(
            out.float(), want_out.float(), rtol=8e-3, atol=1e-6
        )

    def shared(rows: int) -> torch.Tensor:  # the residual stream: the same on every rank
        residual = _integers(rows, size + 1, generator, device)
        dist.broadcast(residual, src=0, group=group.device_group)
        return residual

    one_shot = group.one_shot
    assert one_shot is not None
    # Every size and way, whatever thresholds the timing chose (`partial_rows` applies them).
    staged = [one_shot.staged(rows, HIDDEN, way) for rows, way in CALLS]
    eager = []
    for rows, staged_rows in zip(ROWS_OF_CALLS, staged, strict=True):
        partial, residual = _integers(rows, size + 1, generator, device), shared(rows)
        want = expected(partial, residual.clone())
        staged_rows.rows.copy_(partial)
        out = torch.empty_like(partial)
        staged_rows.reduce_add_norm_(residual, weight, EPS, out)
        eager.append(close((out, residual), want))
    partials = [
        torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=device) for rows in ROWS_OF_CALLS
    ]
    residuals = [torch.zeros_like(p) for p in partials]
    outs = [torch.empty_like(p) for p in partials]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for staged_rows, partial, residual, out in zip(
            staged, partials, residuals, outs, strict=True
        ):
            staged_rows.rows.copy_(partial)  # as a projection writes its partial sums there
            staged_rows.reduce_add_norm_(residual, weight, EPS, out)
    replays = []
    for _ in range(3):
        wants = []
        for partial, residual in zip(partials, residuals, strict=True):
            partial.copy_(_integers(partial.shape[0], size + 1, generator, device))
            residual.copy_(shared(partial.shape[0]))
            wants.append(expected(partial, residual.clone()))
        graph.replay()
        got = zip(outs, residuals, strict=True)
        replays.append(all(close(g, w) for g, w in zip(got, wants, strict=True)))
    torch.cuda.synchronize()
    return {"fused_eager": eager, "fused_replays": replays}


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
        assert found[rank]["fused_eager"] == [True] * len(CALLS), f"rank {rank}: {found[rank]}"
        assert found[rank]["fused_replays"] == [True, True, True], f"rank {rank}: {found[rank]}"
