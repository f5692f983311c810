"""The batch-1 GEMV's tiles timed where they run: in the whole batch-1 forward of a model at a
real shape, projection group by group, in the fused one-token layer (`model/row_fusion.py`:
the norms, residual adds and SwiGLU inside the GEMVs), and the batch-1 ITL before and after.

`gemv_tiles.py` times each tile alone, over the projection's bare product; in the fused layer a
tile also carries its prologue and epilogue (a normed projection's programs each norm the whole
input, so that work is shared by `block_n` rows), and with programmatic dependent launch its
first loads overlap the kernel ahead. So a tile's place in the fused layer can differ from its
place alone. For each weight format this builds the engine (its start-up choice as shipped)
and measures the batch-1 ITL; for those in `--sweep` (FP8 by default) it then times every
`--tiles` tile in each group in the fused layer (the others keeping theirs, as
`gemv_choice.choose_tiles` does), times the start-up's layer against the fused layer on the
best tiles in one interleaved round, re-captures the serving graphs on the faster and measures
the ITL again in the same engine. The report is written after each engine.

    PYTHONPATH=engine:. python benchmarks/layer_tiles.py --shape llama-3.1-8b --json tiles.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_engine import batch1_itl, build_engine, stop_ranks, write_checkpoint
from benchmarks.shapes import SHAPES
from pagekeeper_engine.kernels import supports_pdl
from pagekeeper_engine.kernels.gemv import GemvConfig
from pagekeeper_engine.kernels.graph_timing import best_replays, capture
from pagekeeper_engine.model.gemv_choice import ROUNDS, WARM_UP_S, projection_groups, time_configs
from pagekeeper_engine.model.row_fusion import RowFusion
from pagekeeper_engine.runner.kernel_choice import TIMING_CONTEXT, context_forward
from pagekeeper_engine.runner.runner import ModelRunner

# The shipped tiles' shapes and wider ones: 16 and 32 columns share one normed input among more
# rows; e4m3 tiles of 16 x 512 move the bytes of a bf16 8 x 512 one.
SWEEP = (
    GemvConfig(8, 512),
    GemvConfig(8, 1024),
    GemvConfig(8, 2048, num_warps=8, num_stages=1),
    GemvConfig(4, 4096, num_warps=8, num_stages=1),
    GemvConfig(8, 4096, num_warps=8, num_stages=1),
    GemvConfig(8, 512, num_warps=8),
    GemvConfig(16, 256),
    GemvConfig(16, 512),
    GemvConfig(16, 512, num_warps=8),
    GemvConfig(16, 1024, num_warps=8, num_stages=2),
    GemvConfig(16, 1024, num_warps=8),
    GemvConfig(16, 2048, num_warps=8, num_stages=1),
    GemvConfig(32, 256, num_warps=8),
    GemvConfig(32, 512, num_warps=8, num_stages=2),
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    add("--quantization", nargs="+", choices=["fp8", "none"], default=["fp8", "none"])
    add("--itl-tokens", type=int, default=256)
    add("--tiles", type=int, default=len(SWEEP), help="the first N tiles of the sweep")
    add("--sweep", nargs="*", default=["fp8"], help="formats swept (the others: ITL only)")
    add("--json", default=None)
    # build_engine's settings: a small KV pool and few graph sizes (batch 1 is what is timed)
    add("--max-num-seqs", type=int, default=8)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--block-size", type=int, default=16)
    add("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)
    args.enforce_eager, args.async_scheduling, args.safety = False, True, "on"
    args.kv_cache_dtype, args.tensor_parallel_size = "auto", 1
    return args


def describe(config: GemvConfig) -> str:
    return f"{config.block_n}x{config.block_k}/{config.num_warps}w{config.num_stages}s"


def sweep_layer(runner: ModelRunner, tiles: list[GemvConfig]) -> dict[str, Any]:
    """Time `tiles` group by group in the fused layer; leave the faster of it and the start-up's
    layer set (serving graphs not yet re-captured) and return the figures."""
    model = runner.model
    assert runner.fusion_choice is not None, "the fused layer runs without tensor parallelism"
    started_with = runner.fusion_choice.chosen
    groups = projection_groups(model)
    start_tiles = {key: linears[0].gemv_config for key, linears in groups.items()}
    forward, _ = context_forward(model, runner.inputs, TIMING_CONTEXT)
    fused = RowFusion(pdl=supports_pdl(runner.device))
    model.set_row_fusion(fused)
    per_group: dict[str, dict[str, float]] = {}
    for (name, _, _), linears in sorted(groups.items()):
        seconds = time_configs(linears, tiles, forward)
        per_group[name] = {describe(c): s * 1e6 for c, s in zip(tiles, seconds, strict=True)}
        best = min(zip(seconds, tiles, strict=True), key=lambda pair: pair[0])[1]
        for linear in linears:
            linear.gemv_config = best
        print(f"  {name}: " + ", ".join(f"{t} {us:.0f}" for t, us in per_group[name].items()))
    swept = {key: linears[0].gemv_config for key, linears in groups.items()}

    def set_layer(fusion: RowFusion | None, chosen: dict[Any, GemvConfig | None]) -> None:
        model.set_row_fusion(fusion)
        for key, linears in groups.items():
            for linear in linears:
                linear.gemv_config = chosen[key]

    graphs = []
    for fusion, chosen in ((started_with, start_tiles), (fused, swept)):
        set_layer(fusion, chosen)
        graphs.append(capture(forward))
    start_s, swept_s = best_replays(graphs, ROUNDS, warm_up_s=WARM_UP_S)
    del graphs
    keep_swept = swept_s < start_s
    set_layer(*((fused, swept) if keep_swept else (started_with, start_tiles)))
    return {
        "start_up_layer": "unfused" if started_with is None else f"fused (pdl {started_with.pdl})",
        "start_up_forward_us": start_s * 1e6,
        "swept_forward_us": swept_s * 1e6,
        "swept_tiles": {name: describe(c) for (name, _, _), c in swept.items() if c},
        "per_group_us": per_group,
        "kept": "swept" if keep_swept else "start-up",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    report: dict[str, Any] = {"shape": args.shape, "device": torch.cuda.get_device_name()}
    tiles = list(SWEEP[: args.tiles])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.shape, Path(tmp))
        for quantization in args.quantization:
            print(f"## weights {quantization}")
            engine, start = build_engine(
                model_dir, args, quantization=quantization, kv_cache_memory_bytes=4 << 30
            )
            runner = engine.runner
            assert isinstance(runner, ModelRunner), "one process: the runner is this one's"
            row: dict[str, Any] = {"start": start}
            row["itl_before_s"] = batch1_itl(engine, num_tokens=args.itl_tokens)
            if quantization in args.sweep:
                row.update(sweep_layer(runner, tiles))
                runner.capture_graphs()
                row["itl_after_s"] = batch1_itl(engine, num_tokens=args.itl_tokens)
                print(
                    f"  forward {row['start_up_forward_us']:.0f} us ({row['start_up_layer']}) "
                    f"-> {row['swept_forward_us']:.0f} us fused on the swept tiles; batch-1 ITL "
                    f"{row['itl_before_s'] * 1e3:.3f} -> {row['itl_after_s'] * 1e3:.3f} ms "
                    f"({row['kept']} kept)"
                )
            else:
                row["itl_after_s"] = row["itl_before_s"]  # nothing changed in it
                print(f"  batch-1 ITL {row['itl_before_s'] * 1e3:.3f} ms")
            report[quantization] = row
            if args.json:  # after each engine: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=1))
            del engine, runner
            stop_ranks()
    if "fp8" in report and "none" in report:
        for when in ("before", "after"):
            ratio = report["fp8"][f"itl_{when}_s"] / report["none"][f"itl_{when}_s"]
            report[f"itl_ratio_{when}"] = ratio
            print(f"FP8 / bf16 batch-1 ITL {when}: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
