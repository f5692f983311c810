"""All-reduce time and bandwidth between the GPUs of one host, one process per GPU, as the
tensor-parallel engine runs it: a bf16 tensor of (rows x hidden) summed in place, by NCCL
through torch.distributed and by the one-shot all-reduce over symmetric memory, each rank's rows
pushed to its peers and pulled from them (`distributed/oneshot.py`, set up through
`TensorParallelGroup.enable_one_shot` as the engine does), and the engine's own start-up
choice. Beside them, what a layer runs after each row-parallel projection: the residual-add
RMSNorm kernel alone, and the one-shot path's fused launch each way (the sum of the partial rows
already in the buffer, added into the residual and normed). The decode step's all-reduce term of
the tensor-parallel floor is 2 x layers x the time at the batch's rows (`docs/benchmarks.md`).

    PYTHONPATH=engine python benchmarks/allreduce.py --size 2 --hidden 4096 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagekeeper_engine.distributed.allreduce_choice import AllReduceTiming, combine_rank_timings
from pagekeeper_engine.distributed.group import (
    TensorParallelGroup,
    join_rendezvous,
    serve_rendezvous,
)
from pagekeeper_engine.distributed.oneshot import ONE_SHOT_WAYS
from pagekeeper_engine.kernels.graph_timing import best_replays, capture
from pagekeeper_engine.kernels.rms_norm import rms_norm

ROWS = (1, 8, 64, 256, 2048)
CALLS_PER_GRAPH = 10
ROUNDS = 20  # replays timed; by count alone, as every rank must replay its collectives alike
WARM_UP_ROUNDS = 3
DTYPE = torch.bfloat16


def _graph_us(reduce_: Callable[[torch.Tensor], None], x: torch.Tensor, size: int) -> float:
    """Check that `reduce_` sums right, then its time per call (`_zeros_us`)."""
    for _ in range(20):
        reduce_(x)
    x.fill_(1.0)
    reduce_(x)
    assert float(x[0, 0]) == size and bool((x == size).all()), "the all-reduce summed wrongly"
    return _zeros_us(reduce_, x)


def _zeros_us(run: Callable[[torch.Tensor], None], x: torch.Tensor) -> float:
    """The time per call of `run` on zero rows (the timed sums stay zero instead of
    overflowing): the best of ROUNDS replays of a CUDA graph of CALLS_PER_GRAPH calls (the
    engine replays its all-reduces in graphs, and its start-up choice times them so)."""
    x.zero_()
    run(x)
    graph = capture(functools.partial(run, x), CALLS_PER_GRAPH)
    (seconds,) = best_replays([graph], ROUNDS, warm_up_rounds=WARM_UP_ROUNDS)
    return seconds * 1e6 / CALLS_PER_GRAPH


def _rank(rank: int, size: int, port: int, hiddens: list[int], results: Any) -> None:
    """This rank's timings per hidden size (one-shot at inf where it is off or does not fit)
    and the start-up choice, on the queue."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = TensorParallelGroup.initialize(rank, size, join_rendezvous(port, size), device)
    capacity = max(ROWS) * max(hiddens) * DTYPE.itemsize
    startup = group.enable_one_shot(capacity, hiddens[0], DTYPE)
    one_shot = group.one_shot

    def nccl(x: torch.Tensor) -> None:
        dist.all_reduce(x, group=group.device_group)

    found: dict[int, list[AllReduceTiming]] = {}
    # (norm kernel us, fused launch pushed us, pulled us)
    norms: dict[int, list[tuple[float, float, float]]] = {}
    for hidden in hiddens:
        found[hidden], norms[hidden] = [], []
        weight = torch.ones(hidden, dtype=DTYPE, device=device)
        for rows in ROWS:
            x = torch.zeros(rows, hidden, dtype=DTYPE, device=device)
            nccl_us = _graph_us(nccl, x, size)
            residual = torch.zeros_like(x)
            norm_us = _zeros_us(
                lambda y, r=residual, w=weight: rms_norm(y, w, 1e-6, r, out=y, summed=r), x
            )
            plain, fused = (
                {"push": math.inf, "pull": math.inf},
                {"push": math.inf, "pull": math.inf},
            )
            for way in ONE_SHOT_WAYS:
                # Every rank has the same buffer and shapes, so all take this branch alike.
                if one_shot is None or not one_shot.fits_rows(rows, hidden, DTYPE, way):
                    continue
                plain[way] = _graph_us(functools.partial(one_shot.all_reduce_, way=way), x, size)
                staged = one_shot.staged(rows, hidden, way)
                fused[way] = _zeros_us(
                    lambda y, s=staged, r=residual, w=weight: s.reduce_add_norm_(r, w, 1e-6, y), x
                )
            num_bytes = x.numel() * x.element_size()
            found[hidden].append(AllReduceTiming(num_bytes, nccl_us, plain["push"], plain["pull"]))
            norms[hidden].append((norm_us, fused["push"], fused["pull"]))
    results.put((rank, found, norms, dataclasses.asdict(startup)))
    # no destroy_process_group: with graphs that captured the communicator it can hang; the
    # process's exit releases NCCL


def _row(
    hidden: int, timing: AllReduceTiming, norm: tuple[float, float, float], size: int
) -> dict[str, Any]:
    # NCCL's bus bandwidth of a ring all-reduce: 2 (n - 1) / n of the bytes cross a link
    bus = timing.num_bytes * 2 * (size - 1) / size / timing.nccl_us / 1e3
    return {"hidden": hidden, "rows": timing.num_bytes // (hidden * DTYPE.itemsize),
            "bytes": timing.num_bytes, "nccl_us": timing.nccl_us, "nccl_bus_gb_s": bus,
            "push_us": _finite(timing.push_us), "pull_us": _finite(timing.pull_us),
            "norm_us": norm[0], "fused_push_norm_us": _finite(norm[1]),
            "fused_pull_norm_us": _finite(norm[2])}  # fmt: skip


def _finite(us: float) -> float | None:
    return us if math.isfinite(us) else None


def _us(us: float | None) -> str:
    return f"{us:6.1f} us" if us is not None else "   (off)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "keep NVLink multicast off"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = serve_rendezvous(args.size)
    processes = [
        context.Process(target=_rank, args=(r, args.size, store.port, args.hidden, results))
        for r in range(args.size)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=300) for _ in range(args.size)]
    by_rank = {rank: (found, startup, norms) for rank, found, norms, startup in reports}
    for process in processes:
        process.join()
    found, rows = by_rank[0][0], []
    for hidden in found:
        # each path at its slowest rank
        timings = combine_rank_timings([by_rank[r][0][hidden] for r in range(args.size)])
        slowest_norms = [
            tuple(max(per_rank) for per_rank in zip(*same_rows, strict=True))
            for same_rows in zip(*(by_rank[r][2][hidden] for r in range(args.size)), strict=True)
        ]
        rows += [
            _row(hidden, timing, (norm[0], norm[1], norm[2]), args.size)
            for timing, norm in zip(timings, slowest_norms, strict=True)
        ]
    startup = by_rank[0][1]
    print(f"# all-reduce over {args.size} GPUs ({torch.cuda.get_device_name()}), bf16, in graphs,"
          " the slowest rank's time")  # fmt: skip
    for row in rows:
        print(f"  hidden {row['hidden']:5d} x {row['rows']:5d} rows: NCCL {row['nccl_us']:6.1f} us "
              f"(bus {row['nccl_bus_gb_s']:6.1f} GB/s), push {_us(row['push_us'])}, pull "
              f"{_us(row['pull_us'])}; add-norm {row['norm_us']:5.1f} us, fused sum + "
              f"add-norm: push {_us(row['fused_push_norm_us'])}, "
              f"pull {_us(row['fused_pull_norm_us'])}")  # fmt: skip
    print(f"  start-up choice (hidden {args.hidden[0]}): one-shot up to "
          f"{startup['one_shot_max_bytes']} bytes, pushed up to {startup['push_max_bytes']}, "
          f"off: {startup['off_reason']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            summary = {
                "size": args.size,
                "device": torch.cuda.get_device_name(),
                "rows": rows,
                "startup": startup,
            }
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
