"""Which projections run the Triton GEMV at batch 1: measured at start-up, in the model.

A batch-1 decode step is a chain of matrix-vector products whose time is the weight's bytes over
memory bandwidth plus a ramp at either end. cuBLAS reaches 60-72% of the copy rate on the small
square projections of an 8B model and ~95% on the wide gate/up one; the Triton GEMV
(`kernels/gemv.py`) is ahead on the former, and where the line falls depends on the GPU and the
shapes. Timing a projection alone does not settle it: on an H200 the gate/up GEMV and cuBLAS tied
alone (56.8 against 56.0 us) while in the model the GEMV made the whole step 0.15 ms faster and its
other tile 0.13 ms slower (docs/benchmarks-archive.md, "the GEMV chosen in the model"). So the
runner times what runs: for each projection group in turn, a CUDA graph of the whole batch-1 forward
with cuBLAS and with each GEMV tile, replays interleaved, and keeps the GEMV where the step is at
least `1 - MARGIN` faster. Results are equal to rounding either way.

Then the same timing decides the fused one-token layer (`model/row_fusion.py`: the norms, the
residual adds and SwiGLU inside the GEMVs), with and without programmatic dependent launch where the
GPU has it, against the layer as chosen above; a near-tie goes to the fused layer (`decide_fusion`).
The fused layer runs the GEMV in every projection, and the tile that serves it best is not the one
that serves the unfused layer best (on an H200 the wide tiles won the 8B's unfused layer and made
its fused layer 8% slower, so the start-up kept the unfused one; docs/benchmarks-archive.md,
"whole-row GEMV tiles"): its tiles are timed in it (`choose_tiles`), and each variant is timed with
its own.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagekeeper_engine.kernels.graph_timing import best_replays, capture
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.model.row_fusion import RowFusion

if TYPE_CHECKING:
    from pagekeeper_engine.kernels.gemv import GemvConfig

logger = logging.getLogger(__name__)

MARGIN = 0.995  # the step must be 0.5% faster with the GEMV: closer calls keep cuBLAS
# The unfused layer is kept only where its timed forward is at least 3% faster than the fused
# layer's: the fused layer serves faster than that timing says (`decide_fusion`).
FUSION_MARGIN = 0.97
ROUNDS = 5  # timed replays of each variant, interleaved so that clock drift hits all alike
# Untimed replays first: without them the first figures at start-up ran 10-20% slow and varied
# from start to start (cuBLAS on the 8B gate/up: 61.5, 67.2, 63.6 us; 56.0 us once warm).
WARM_UP_S = 0.05


@dataclass(frozen=True)
class GemvChoice:
    """The decision for one group of projections (same name and shape in every layer), with
    the batch-1 forward's time under each side."""

    name: str
    out_features: int
    in_features: int
    num_layers: int
    cublas_step_us: float
    gemv_step_us: float  # with the best GEMV tile
    config: GemvConfig | None  # None: cuBLAS is kept

    def describe(self) -> str:
        pick = "cuBLAS" if self.config is None else f"Triton GEMV {self.config.describe()}"
        return (
            f"{self.name} ({self.out_features}x{self.in_features}): {pick} (batch-1 step "
            f"{self.gemv_step_us:.0f} us with the GEMV, {self.cublas_step_us:.0f} us with cuBLAS)"
        )


@dataclass(frozen=True)
class FusionChoice:
    """Whether one-token steps run the fused layer, with the batch-1 forward's time under each
    variant timed (None: the unfused layer)."""

    step_us: dict[RowFusion | None, float]
    chosen: RowFusion | None
    fused_tiles: dict[str, GemvConfig] = field(default_factory=dict)  # by projection

    def describe(self) -> str:
        def name(fusion: RowFusion | None) -> str:
            if fusion is None:
                return "unfused"
            return "fused with PDL" if fusion.pdl else "fused"

        timed = ", ".join(f"{us:.0f} us {name(f)}" for f, us in self.step_us.items())
        tiles = ""
        if self.chosen is not None:
            each = ", ".join(f"{n} {c.describe()}" for n, c in sorted(self.fused_tiles.items()))
            tiles = f"; its tiles {each}"
        return f"one-token layer: {name(self.chosen)} (batch-1 step {timed}{tiles})"


def projection_groups(model: nn.Module) -> dict[tuple[str, int, int], list[Linear]]:
    """Projections by (name within a layer, out, in): the lm_head is not a projection of the
    decoder's layers (its logits matmul bypasses `Linear.forward`) and stays with cuBLAS."""
    groups: dict[tuple[str, int, int], list[Linear]] = defaultdict(list)
    for qualified, module in model.named_modules():
        if isinstance(module, Linear) and ".layers." in qualified:
            name = qualified.rsplit(".", 1)[-1]
            out_features, in_features = module.weight.shape
            groups[(name, out_features, in_features)].append(module)
    return groups


@torch.inference_mode()
def choose_gemv(model: nn.Module, forward: Callable[[], object]) -> list[GemvChoice]:
    """Decide, group by group, between cuBLAS and each GEMV tile by timing `forward` (a batch-1
    forward pass of `model`, e.g. over padding inputs); set `Linear.gemv_config` accordingly
    and return the decisions. Groups decided earlier keep their choice while later ones are
    timed; the undecided ones run the first GEMV tile."""
    from pagekeeper_engine.kernels.gemv import CANDIDATES  # noqa: PLC0415 (imports triton)

    groups = projection_groups(model)
    # The groups interact (on an H200: from all-cuBLAS, one pass kept cuBLAS for gate/up and qkv,
    # each a tie or a loss alone, and the step took 4.46 ms; both on the GEMV gave 4.34 ms),
    # so the pass starts from every group on the first tile.
    for linears in groups.values():
        _assign(linears, CANDIDATES[0])
    choices = []
    for (name, out_features, in_features), linears in sorted(groups.items()):
        cublas, *timed = time_configs(linears, [None, *CANDIDATES], forward)
        best_s, best_config = min(zip(timed, CANDIDATES, strict=True), key=lambda pair: pair[0])
        chosen = best_config if best_s < MARGIN * cublas else None
        _assign(linears, chosen)
        choice = GemvChoice(
            name,
            out_features,
            in_features,
            len(linears),
            cublas_step_us=cublas * 1e6,
            gemv_step_us=best_s * 1e6,
            config=chosen,
        )
        logger.info("batch-1 projection %s", choice.describe())
        choices.append(choice)
    return choices


def _assign(linears: list[Linear], config: GemvConfig | None) -> None:
    for linear in linears:
        linear.gemv_config = config


def time_configs(
    linears: list[Linear],
    configs: Sequence[GemvConfig | None],
    forward: Callable[[], object],
) -> list[float]:
    """Seconds of `forward`'s best replay with `linears` on each of `configs` (captured one
    after the other, replayed interleaved); leaves them on the last."""
    graphs = []
    for config in configs:
        _assign(linears, config)
        graphs.append(capture(forward))
    return best_replays(graphs, ROUNDS, warm_up_s=WARM_UP_S)


Tiles = dict[tuple[str, int, int], "GemvConfig | None"]  # by projection group


@torch.inference_mode()
def choose_tiles(model: nn.Module, forward: Callable[[], object]) -> Tiles:
    """Group by group, the GEMV tile under which `forward` (a batch-1 forward, in the layer
    variant that is set) is fastest, the other groups keeping theirs (a group on cuBLAS starts
    from the first tile); sets them and returns every group's."""
    from pagekeeper_engine.kernels.gemv import CANDIDATES  # noqa: PLC0415 (imports triton)

    groups = projection_groups(model)
    for linears in groups.values():
        if linears[0].gemv_config is None:
            _assign(linears, CANDIDATES[0])
    for _, linears in sorted(groups.items()):
        timed = time_configs(linears, CANDIDATES, forward)
        _assign(linears, min(zip(timed, CANDIDATES, strict=True), key=lambda pair: pair[0])[1])
    return _tiles(groups)


@torch.inference_mode()
def choose_row_fusion(
    model: nn.Module,
    set_fusion: Callable[[RowFusion | None], None],
    forward: Callable[[], object],
    pdl: bool,
) -> FusionChoice:
    """Time `forward` (a batch-1 forward of `model`) with the layer unfused, fused, and (`pdl`)
    fused with programmatic dependent launch, the unfused layer with the projections as they
    are set and the fused ones with the tiles `choose_tiles` finds in the last of them; keep
    `decide_fusion`'s pick and leave it and its tiles set."""
    fused_variants = [RowFusion(pdl=False), *([RowFusion(pdl=True)] if pdl else [])]
    groups = projection_groups(model)
    unfused_tiles = _tiles(groups)
    fused_tiles = unfused_tiles
    for fusion in reversed(fused_variants):
        set_fusion(fusion)
        try:
            fused_tiles = choose_tiles(model, forward)
            break
        except RuntimeError as exc:  # a driver that cannot capture dependent launches
            if not fusion.pdl:
                raise
            logger.warning("batch-1 layer: no programmatic dependent launch (%s)", exc)
            fused_variants.remove(fusion)
            _set_tiles(groups, unfused_tiles)
    variants: list[RowFusion | None] = [None, *fused_variants]
    graphs = []
    for variant in variants:
        set_fusion(variant)
        _set_tiles(groups, unfused_tiles if variant is None else fused_tiles)
        graphs.append(capture(forward))
    seconds = best_replays(graphs, ROUNDS, warm_up_s=WARM_UP_S)
    del graphs
    timed = dict(zip(variants, seconds, strict=True))
    chosen = decide_fusion(timed)
    set_fusion(chosen)
    _set_tiles(groups, unfused_tiles if chosen is None else fused_tiles)
    by_name = {name: config for (name, _, _), config in fused_tiles.items() if config is not None}
    choice = FusionChoice({f: s * 1e6 for f, s in timed.items()}, chosen, by_name)
    logger.info("batch-1 %s", choice.describe())
    return choice


def _tiles(groups: dict[tuple[str, int, int], list[Linear]]) -> Tiles:
    return {key: linears[0].gemv_config for key, linears in groups.items()}


def _set_tiles(groups: dict[tuple[str, int, int], list[Linear]], tiles: Tiles) -> None:
    for key, linears in groups.items():
        _assign(linears, tiles[key])


def decide_fusion(seconds: dict[RowFusion | None, float]) -> RowFusion | None:
    """The fastest fused variant (keys other than None), unless the unfused layer's forward (None)
    is at least `1 - FUSION_MARGIN` faster than it. A near-tie goes to the fused layer: the timed
    forward understates what it saves in serving, by about 3% of the step in both cases measured
    (one process, the layer re-captured each way): the 8B on an H200, forward 55 us faster fused
    with PDL and inter-token latency 4.07 against 4.23 ms; the 8B with FP8 weights on an H100,
    forward 21 us faster fused with PDL and latency 3.40 against 3.50 ms, where the start-up's
    own timing had kept the unfused layer by 32 us (docs/benchmarks-archive.md, "a layer's
    projections after its attention"; docs/benchmarks.md, "Also measured", run 57)."""
    unfused = seconds[None]
    fused = [(s, fusion) for fusion, s in seconds.items() if fusion is not None]
    if not fused:
        return None
    best_s, best = min(fused, key=lambda pair: pair[0])
    return None if unfused < FUSION_MARGIN * best_s else best
