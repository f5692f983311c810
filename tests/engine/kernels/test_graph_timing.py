"""The capture helper: no cyclic garbage collection inside a CUDA graph capture.

On the CPU: `gc_paused` turns the collector off inside its block and restores what it found,
also when the block raises. On a GPU: a graph held only by a reference cycle survives a
capture whose callable allocates enough to trigger automatic collections (with the collector
running, the cycle's graph would be destroyed mid-capture and the capture invalidated)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from pagekeeper_engine.kernels.graph_timing import capture, gc_paused


@pytest.fixture
def collector_state() -> Iterator[None]:
    was_enabled, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was_enabled else gc.disable)()


@pytest.mark.usefixtures("collector_state")
@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_inside_and_restored_after(enabled_before: bool) -> None:
    (gc.enable if enabled_before else gc.disable)()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled() is enabled_before
    with pytest.raises(ValueError, match="inside"), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled() is enabled_before


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.me = self


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("collector_state")
def test_a_graph_dropped_in_a_cycle_during_a_capture_does_not_break_it() -> None:
    x = torch.zeros(64, device="cuda")
    held = [capture(lambda: x.add_(1))]
    calls = []
    cycles: list[weakref.ref[_Cycle]] = []
    alive_after_junk = []

    def step() -> None:
        calls.append(len(calls))
        x.add_(10)
        if len(calls) == 2:  # the captured call (the first runs eagerly, before the capture)
            cycles.append(weakref.ref(_Cycle(held.pop())))  # the earlier graph, unreachable
            gc.set_threshold(1, 1, 1)  # a collection at the next tracked allocation...
            junk = [[i] for i in range(100)]  # ...which these are
            assert len(junk) == 100
            alive_after_junk.append(cycles[0]() is not None)

    graph = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 1 + 10 + 10).item()  # the first graph's eager call, step's, a replay
    assert alive_after_junk == [True]  # no collection inside the capture
    gc.collect()
    assert cycles[0]() is None  # outside it, the cycle and its graph go
