# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The batch-1 GEMV's tiles at one model's projection shapes, bf16 against FP8 weights: each
tile's bandwidth as a share of the measured copy rate (bytes read + written per second).

A batch-1 projection reads its weight once, so its floor is the weight's bytes over the copy
rate. An e4m3 tile of the same shape as a bf16 one moves half the bytes per loop iteration, so
half as many bytes are in flight per program: if that were what holds the FP8 GEMV back, tiles
twice as long in K would close the gap. The sweep (FP8 only; bf16's tiles were swept before)
tries them beside the shipped ones. Every timing replays a CUDA graph over enough distinct
weights that the L2 cache never holds the one a call reads.

For FP8 each projection also gets its reads' ceiling: the same weights read through each shipped
tile by a kernel that only folds the loaded words together (`read_tiles`, one XOR per 4-byte word
where the GEMV widens each byte to fp32 and multiplies it). A GEMV near that ceiling is bound by
its reads (tile shape, bytes in flight, the ramp at either end); one well under it, by the work
done on each element it read.

    PYTHONPATH=engine:. python benchmarks/gemv_tiles.py --shape llama-3.1-8b --json tiles.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import ROTATE_BYTES, measure_copy_bandwidth, time_graph
from benchmarks.shapes import SHAPES
from pagekeeper_engine.kernels.gemv import CANDIDATES, GemvConfig, gemv
from pagekeeper_engine.model.fp8 import quantize_rows

# Tiles of 1-4k elements in K, 8 or 16 columns: up to 4x the shipped tiles' bytes per load.
SWEEP_N = (8, 16)
SWEEP_K = (1024, 2048, 4096)
SWEEP_WARPS_STAGES = ((4, 3), (8, 1), (8, 3))


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of a layer (gate and up fused, as the engine holds them)."""
    cfg = SHAPES[shape]
    hidden, inter, head = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


@triton.jit
def _read_tiles_kernel(w_ptr, out_ptr, K_WORDS, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.arange(0, BLOCK_W)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K_WORDS + offs[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for _ in range(0, K_WORDS, BLOCK_W):
        acc ^= tl.load(ptrs, eviction_policy="evict_first")
        ptrs += BLOCK_W
    tl.store(out_ptr + rows, tl.xor_sum(acc, axis=1))


def read_tiles(weight: torch.Tensor, out: torch.Tensor, config: GemvConfig) -> None:
    """Fold each row of a (N, K) one-byte weight into out[row] through `config`'s tiles (4-byte
    words: a tile of block_k bytes is block_k / 4 of them), the GEMV's reads without its math."""
    n, k = weight.shape
    assert weight.element_size() == 1 and weight.is_contiguous(), "a contiguous FP8 weight"
    assert n % config.block_n == 0 and k % config.block_k == 0, "whole tiles only"
    assert out.shape == (n,) and out.dtype == torch.int32
    words = weight.view(torch.int32)  # (N, K / 4)
    _read_tiles_kernel[(n // config.block_n,)](
        words, out, k // 4, BLOCK_N=config.block_n, BLOCK_W=config.block_k // 4,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def read_ceiling(
    weights: list[torch.Tensor], configs: list[GemvConfig], copy: float
) -> list[dict[str, Any]]:
    """Each shipped tile's reads alone, as a share of the copy rate."""
    n, k = weights[0].shape
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    rows = []
    for config in configs:
        if n % config.block_n or k % config.block_k:
            continue
        calls = [(lambda w=w, c=config: read_tiles(w, out, c)) for w in weights]
        rows.append(timed_row(config, time_graph(calls), n * k, copy))
    return rows


def timed_row(config: GemvConfig, seconds: float, nbytes: int, copy: float) -> dict[str, Any]:
    """One tile's timing: its seconds a call and the share of the copy rate its bytes reach."""
    return {
        "config": config.describe(), "stages": config.num_stages,
        "us": seconds * 1e6, "share_of_copy": nbytes / seconds / copy,
    }  # fmt: skip


def sweep_configs() -> list[GemvConfig]:
    return [
        GemvConfig(n, k, warps, stages)
        for n, k, (warps, stages) in itertools.product(SWEEP_N, SWEEP_K, SWEEP_WARPS_STAGES)
    ]


def bench(n: int, k: int, fp8: bool, configs: list[GemvConfig], copy: float) -> dict[str, Any]:
    """Each config's share of the copy rate for one (N, K) projection."""
    per_weight = n * k * (1 if fp8 else 2)
    copies = max(2, -(-ROTATE_BYTES // per_weight))
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    weights: list[torch.Tensor] = []
    scales: list[torch.Tensor | None] = []
    for _ in range(copies):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        if fp8:
            q, s = quantize_rows(w)
            weights.append(q)
            scales.append(s.reshape(n).float().contiguous())
        else:
            weights.append(w)
            scales.append(None)
    rows = []
    for config in configs:  # the shipped tiles first, then the sweep's
        if config.block_k > 2 * k:  # a tile past twice the row reads mostly masked lanes
            continue
        calls = [
            (lambda w=w, s=s, c=config: gemv(x, w, config=c, weight_scale=s))
            for w, s in zip(weights, scales, strict=True)
        ]
        rows.append(timed_row(config, time_graph(calls), per_weight, copy))
    result = {"n": n, "k": k, "fp8": fp8, "weight_bytes": per_weight, "rows": rows}
    if fp8:
        result["read_ceiling"] = read_ceiling(weights, list(CANDIDATES), copy)
    return result


def describe(row: dict[str, Any]) -> str:
    return f"{row['config']}/{row['stages']} {row['share_of_copy']:.0%} ({row['us']:.1f} us)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--shipped-only", action="store_true", help="only the shipped tiles")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy = measure_copy_bandwidth()  # bytes read + written per second
    report: dict[str, Any] = {"shape": args.shape, "copy_bytes_s": copy, "results": []}
    print(f"# copy: {copy / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")
    for fp8 in (False, True):
        shipped = list(CANDIDATES)
        configs = shipped if args.shipped_only or not fp8 else shipped + sweep_configs()
        for name, (n, k) in projections(args.shape).items():
            result = bench(n, k, fp8, configs, copy)
            result["projection"] = name
            report["results"].append(result)
            timed = [r for r in result["rows"] if "us" in r]
            best = max(timed, key=lambda r: r["share_of_copy"])
            shipped_keys = {(c.describe(), c.num_stages) for c in shipped}  # rows may be skipped
            best_shipped = max(
                (r for r in timed if (r["config"], r["stages"]) in shipped_keys),
                key=lambda r: r["share_of_copy"],
            )
            print(
                f"{'fp8 ' if fp8 else 'bf16'} {name:>7} ({n}x{k}): shipped best "
                f"{describe(best_shipped)}; sweep best {describe(best)}",
                flush=True,
            )
            if fp8:
                ceiling = max(result["read_ceiling"], key=lambda r: r["share_of_copy"])
                print(f"     {name:>7} reads alone, best shipped tile: {describe(ceiling)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
