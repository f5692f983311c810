"""Which projections run the Triton GEMV at batch 1: measured at start-up, per weight shape.

A batch-1 decode step is a chain of matrix-vector products whose time is the weight's bytes
over memory bandwidth plus a ramp at either end. cuBLAS reaches 60-72% of the copy rate on the
small square projections of an 8B model and ~95% on the wide gate/up one; the Triton GEMV
(`kernels/gemv.py`) is ahead on the former and behind on the latter (docs/benchmarks.md, run
11), and where the line falls depends on the GPU and the shapes. So the runner times both on
this device: each candidate runs over every layer's weight of one shape, captured in a CUDA
graph (no launch overhead in the figure) and together larger than the L2 cache for any model
big enough for the choice to matter (no reuse between calls), and the GEMV is kept only where
it is faster by a clear margin. Results are equal to rounding either way.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagekeeper_engine.model.layers import Linear

if TYPE_CHECKING:
    from pagekeeper_engine.kernels.gemv import GemvConfig

logger = logging.getLogger(__name__)

MARGIN = 0.97  # the GEMV must be at least 3% faster: closer calls are noise, and cuBLAS is kept
REPEATS = 3


@dataclass(frozen=True)
class GemvChoice:
    """The decision for one group of projections (same name and shape in every layer)."""

    name: str
    out_features: int
    in_features: int
    num_layers: int
    cublas_us: float
    gemv_us: float
    config: GemvConfig | None  # None: cuBLAS is kept

    def describe(self) -> str:
        pick = "Triton GEMV" if self.config is not None else "cuBLAS"
        return (
            f"{self.name} ({self.out_features}x{self.in_features}): {pick} "
            f"(GEMV {self.gemv_us:.1f} us, cuBLAS {self.cublas_us:.1f} us)"
        )


def _groups(model: nn.Module) -> dict[tuple[str, int, int], list[Linear]]:
    """Projections by (name within a layer, out, in): the lm_head is not a projection of the
    decoder's layers (its logits matmul bypasses `Linear.forward`) and stays with cuBLAS."""
    groups: dict[tuple[str, int, int], list[Linear]] = defaultdict(list)
    for qualified, module in model.named_modules():
        if isinstance(module, Linear) and ".layers." in qualified:
            name = qualified.rsplit(".", 1)[-1]
            out_features, in_features = module.weight.shape
            groups[(name, out_features, in_features)].append(module)
    return groups


def _time_per_call(call: Callable[[Linear], object], linears: list[Linear]) -> float:
    """Seconds per call, from CUDA-graph replays of one call per layer."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        call(linears[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for linear in linears:
            call(linear)
    graph.replay()
    best = float("inf")
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(linears))
    return best


@torch.inference_mode()
def choose_gemv(model: nn.Module, device: torch.device) -> list[GemvChoice]:
    """Time cuBLAS against each GEMV candidate for every projection shape of `model`, set
    `Linear.gemv_config` where the GEMV wins, and return the decisions."""
    choices = []
    for (name, out_features, in_features), linears in sorted(_groups(model).items()):
        choice = _choose(name, out_features, in_features, linears, device)
        for linear in linears:
            linear.gemv_config = choice.config
        logger.info("batch-1 projection %s", choice.describe())
        choices.append(choice)
    return choices


def _choose(
    name: str, out_features: int, in_features: int, linears: list[Linear], device: torch.device
) -> GemvChoice:
    from pagekeeper_engine.kernels.gemv import CANDIDATES, gemv  # noqa: PLC0415 (imports triton)

    dtype = linears[0].weight.dtype
    x = torch.randn((1, in_features), dtype=dtype, device=device)
    out = torch.empty((1, out_features), dtype=dtype, device=device)
    for linear in linears:
        linear.gemv_config = None  # Linear.forward is cuBLAS now
    cublas = _time_per_call(lambda lin: lin(x, out=out), linears)

    def through_gemv(config: GemvConfig) -> Callable[[Linear], object]:
        return lambda lin: gemv(x, lin.weight, lin.bias, out=out, config=config)

    best_s, best_config = min(
        ((_time_per_call(through_gemv(cfg), linears), cfg) for cfg in CANDIDATES),
        key=lambda pair: pair[0],
    )
    return GemvChoice(
        name,
        out_features,
        in_features,
        len(linears),
        cublas_us=cublas * 1e6,
        gemv_us=best_s * 1e6,
        config=best_config if best_s < MARGIN * cublas else None,
    )
