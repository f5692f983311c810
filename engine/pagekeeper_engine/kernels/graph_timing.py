"""Timing what a step runs as a CUDA graph, for the choices made at start-up by measurement
(the batch-1 GEMV and fused layer in `model/gemv_choice.py`, the all-reduce path in
`distributed/oneshot.py`).

A callable is run once outside the capture (its kernels compile, a collective makes its first
connection) and then captured; graphs are timed by replaying them in interleaved rounds, so
that a clock or a neighbour's load that drifts during the timing hits every variant alike, and
each keeps its best round.

Every capture runs with Python's cyclic garbage collector paused (`gc_paused`): a collection
that fires inside a capture can destroy a graph held only by unreachable objects (an earlier
runner, a graph dropped in a reference cycle), and CUDA invalidates a capture during which
another graph is destroyed. The capture then fails, and the generator it registered stays in
capture mode, so every later random draw in the process fails too.

The call before a capture runs on the current stream, as the step graphs' warm-up does. cuBLAS keeps
a workspace (32 MiB on Hopper) for every stream it has run on, allocated from the caching allocator
and never freed, so each further stream would hold 32 MiB more for the process's life
(docs/benchmarks-archive.md, "what the start-up choices left outside the budget"). With the current
stream and the graphs' own capture stream, a process holds two.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import torch


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (reference counting still frees); the
    collector's earlier state is restored after it. Around every CUDA graph capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture(fn: Callable[[], object], repeats: int = 1) -> torch.cuda.CUDAGraph:
    """A graph of `repeats` calls of `fn`, after one call outside the capture (on the current
    stream)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    """One replay's device time."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def best_replays(
    graphs: Sequence[torch.cuda.CUDAGraph],
    rounds: int,
    *,
    warm_up_rounds: int = 0,
    warm_up_s: float = 0.0,
) -> list[float]:
    """Each graph's best replay in seconds over `rounds` interleaved rounds, after
    `warm_up_rounds` untimed rounds and then more until `warm_up_s` seconds of replays (the
    clocks ramp up, the graphs upload). Graphs that hold a collective must warm up by count
    alone (`warm_up_s` 0): every rank has to replay them the same number of times, or one
    waits forever for a peer that stopped."""
    for _ in range(warm_up_rounds):
        for graph in graphs:
            graph.replay()
    warmed = 0.0
    while warmed < warm_up_s:
        warmed += sum(replay_seconds(graph) for graph in graphs)
    best = [float("inf")] * len(graphs)
    for _ in range(rounds):
        best = [min(b, replay_seconds(graph)) for b, graph in zip(best, graphs, strict=True)]
    return best
