"""Paged-attention kernel benchmarks against the ceilings measured on the same GPU.

Decode attention is bandwidth-bound: its floor is the KV bytes it must read over the measured
device-to-device copy bandwidth. Prefill attention is compute-bound: its floor is its FLOPs over
the measured bf16 matmul rate, and torch's SDPA (flash attention on a contiguous, unpaged copy)
runs beside it as a peer. Every timing replays a CUDA graph of several calls over disjoint
blocks, so launch gaps stay out and the L2 cache never holds the data of the call it serves.

    PYTHONPATH=engine python benchmarks/kernels.py [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from pagekeeper_engine.kernels.kv_write import write_kv
from pagekeeper_engine.kernels.paged_decode import choose_num_splits, paged_decode
from pagekeeper_engine.kernels.paged_prefill import paged_prefill
from pagekeeper_engine.kernels.reference import rms_norm_ref, rotary_ref
from pagekeeper_engine.kernels.rms_norm import rms_norm
from pagekeeper_engine.kernels.rotary import apply_rotary_

ROTATE_BYTES = 512 * 2**20  # each timed graph touches at least this much distinct memory
MAX_ROTATIONS = 32


def time_graph(
    calls: Sequence[Callable[..., Any]], num_replays: int = 10, repeats: int = 5
) -> float:
    """Median seconds per call: `calls` captured into one CUDA graph and replayed."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / num_replays / len(calls))
    return float(statistics.median(samples))


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second by an eager 4 GiB device-to-device copy (median of 10).

    Eager, not graph-captured: a memcpy node in a CUDA graph may run on a copy engine, which
    moves far less than the SMs do.
    """
    src = torch.randn(2**31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(samples)


def measure_matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = time_graph([lambda: a @ b], num_replays=5)
    return 2 * n**3 / seconds


class PagedSetup:
    """A paged cache holding `num_rotations` disjoint copies of a batch of sequences."""

    def __init__(
        self,
        batch: int,
        seq_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.kv_bytes = 2 * batch * seq_len * num_kv_heads * head_dim * dtype.itemsize
        self.num_rotations = max(1, min(MAX_ROTATIONS, -(-ROTATE_BYTES // self.kv_bytes)))
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = self.num_rotations * batch * blocks_per_seq
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda")
        # Scattered blocks, as a long-running server's free list hands them out.
        order = torch.randperm(num_blocks, device="cuda").to(torch.int32)
        self.block_tables = list(order.view(self.num_rotations, batch, blocks_per_seq))
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")


def bench_decode(
    batch: int,
    seq_len: int,
    bandwidth: float,
    num_sms: int,
    *,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    waves: float = 2.0,
    num_splits: int | None = None,
    **launch: int,
) -> dict[str, Any]:
    setup = PagedSetup(
        batch, seq_len, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    splits = num_splits or choose_num_splits(batch, num_kv_heads, seq_len, num_sms, waves)
    q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    calls = [
        lambda table=table: paged_decode(
            q,
            setup.k_cache,
            setup.v_cache,
            table,
            setup.seq_lens,
            head_dim**-0.5,
            out=out,
            num_splits=splits,
            **launch,
        )
        for table in setup.block_tables
    ]
    seconds = time_graph(calls)
    return {
        "kernel": "decode",
        "batch": batch,
        "seq_len": seq_len,
        "num_splits": splits,
        **launch,
        "us": seconds * 1e6,
        "tb_per_s": 2 * batch * seq_len * num_kv_heads * head_dim * 2 / seconds / 1e12,
        "fraction_of_copy": 2 * batch * seq_len * num_kv_heads * head_dim * 2 / seconds / bandwidth,
    }


def bench_prefill(
    batch: int,
    seq_len: int,
    matmul_rate: float,
    *,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    **launch: int,
) -> dict[str, Any]:
    """Fresh prompts of `seq_len` tokens each, against SDPA on the same (unpaged) data."""
    setup = PagedSetup(
        batch, seq_len, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    num_tokens = batch * seq_len
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    starts = torch.arange(0, num_tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    calls = [
        lambda table=table: paged_prefill(
            q,
            setup.k_cache,
            setup.v_cache,
            table,
            setup.seq_lens,
            starts,
            seq_len,
            head_dim**-0.5,
            out=out,
            **launch,
        )
        for table in setup.block_tables
    ]
    seconds = time_graph(calls)
    # Causal: each of the H heads does two (L x L / 2) x D matmuls per sequence.
    flops = 2 * 2 * batch * num_heads * head_dim * seq_len * (seq_len + 1) / 2
    qs = q.view(batch, seq_len, num_heads, head_dim).transpose(1, 2)
    ks = torch.randn(batch, num_kv_heads, seq_len, head_dim, dtype=torch.bfloat16, device="cuda")
    vs = torch.randn_like(ks)
    sdpa = time_graph(
        [lambda: scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)]
    )
    return {
        "kernel": "prefill",
        "batch": batch,
        "seq_len": seq_len,
        **launch,
        "us": seconds * 1e6,
        "tflops": flops / seconds / 1e12,
        "fraction_of_matmul": flops / seconds / matmul_rate,
        "sdpa_us": sdpa * 1e6,
        "ratio_to_sdpa": sdpa / seconds,
    }


def bench_kv_write(
    num_tokens: int, bandwidth: float, num_kv_heads: int = 8, head_dim: int = 128
) -> dict[str, Any]:
    num_blocks = num_tokens // 16 * 4
    shape = (num_blocks, 16, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:num_tokens]
    seconds = time_graph([lambda: write_kv(k, v, k_cache, v_cache, slots)])
    moved = 2 * 2 * k.numel() * k.element_size() + slots.numel() * 8
    return {
        "kernel": "kv_write",
        "tokens": num_tokens,
        "us": seconds * 1e6,
        "fraction_of_copy": moved / seconds / bandwidth,
    }


def eager_seconds(call: Callable[[], Any], num_calls: int = 200) -> float:
    """Wall seconds per call issued back to back: host launch cost included, as eager runs."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_calls


def bench_fused(num_tokens: int, hidden: int = 1024, num_heads: int = 16) -> dict[str, Any]:
    """Fused add+RMSNorm and q/k rotary against the torch ops they replace (Qwen3-0.6B shape)."""
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(num_tokens, num_heads + 16, 128, dtype=torch.bfloat16, device="cuda")
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + 8]
    angles = torch.rand(4096, 64, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    variants = {
        "add_rms_norm": (
            lambda: rms_norm(x, weight, 1e-6, residual),
            lambda: rms_norm_ref(x, weight, 1e-6, residual),
        ),
        "rotary_qk": (
            lambda: apply_rotary_(q, k, positions, cos, sin),
            lambda: (rotary_ref(q, positions, cos, sin), rotary_ref(k, positions, cos, sin)),
        ),
    }
    row: dict[str, Any] = {"kernel": "fused", "tokens": num_tokens}
    for name, (fused, torch_ops) in variants.items():
        row[f"{name}_graph_us"] = time_graph([fused]) * 1e6
        row[f"{name}_torch_graph_us"] = time_graph([torch_ops]) * 1e6
        row[f"{name}_eager_us"] = eager_seconds(fused) * 1e6
        row[f"{name}_torch_eager_us"] = eager_seconds(torch_ops) * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also try launch variants")
    parser.add_argument("--json", default=None, help="write every result to this file")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth, matmul_rate = measure_copy_bandwidth(), measure_matmul_rate()
    print(
        f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}"
    )
    print(
        f"# copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{matmul_rate / 1e12:.0f} TFLOP/s"
    )
    results: list[dict[str, Any]] = []
    num_sms = props.multi_processor_count
    if args.sweep:
        for batch, seq_len in ((1, 4096), (16, 4096), (256, 2048)):
            for block_n, num_warps, num_stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
                results.append(
                    bench_decode(
                        batch,
                        seq_len,
                        bandwidth,
                        num_sms,
                        block_n=block_n,
                        num_warps=num_warps,
                        num_stages=num_stages,
                    )
                )
                print(results[-1])
        for batch, waves in itertools.product((1, 4, 16, 32), (1.0, 2.0, 4.0)):
            results.append(bench_decode(batch, 4096, bandwidth, num_sms, waves=waves))
            results[-1]["waves"] = waves
            print(results[-1])
        for block_m, block_n, num_warps, num_stages in itertools.product(
            (64, 128), (32, 64), (4, 8), (2, 3)
        ):
            results.append(
                bench_prefill(
                    8,
                    1024,
                    matmul_rate,
                    block_m=block_m,
                    block_n=block_n,
                    num_warps=num_warps,
                    num_stages=num_stages,
                )
            )
            print(results[-1])
    print("\n| batch | context | splits | us | TB/s | of copy |")
    print("|---|---|---|---|---|---|")
    for batch, seq_len in itertools.product((1, 4, 16, 64, 256), (1024, 4096, 8192)):
        row = bench_decode(batch, seq_len, bandwidth, num_sms)
        results.append(row)
        print(
            f"| {batch} | {seq_len} | {row['num_splits']} | {row['us']:.1f} | "
            f"{row['tb_per_s']:.2f} | {row['fraction_of_copy']:.0%} |"
        )
    print("\n| prefill batch x len | us | TFLOP/s | of matmul | SDPA us | SDPA / ours |")
    print("|---|---|---|---|---|---|")
    for batch, seq_len in ((8, 1024), (2, 4096), (32, 256)):
        row = bench_prefill(batch, seq_len, matmul_rate)
        results.append(row)
        print(
            f"| {batch} x {seq_len} | {row['us']:.1f} | {row['tflops']:.0f} | "
            f"{row['fraction_of_matmul']:.0%} | {row['sdpa_us']:.1f} | "
            f"{row['ratio_to_sdpa']:.2f} |"
        )
    for num_tokens in (256, 8192):
        row = bench_fused(num_tokens)
        results.append(row)
        print(
            ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    for num_tokens in (256, 8192):
        row = bench_kv_write(num_tokens, bandwidth)
        results.append(row)
        print(
            f"kv_write {num_tokens} tokens: {row['us']:.1f} us, "
            f"{row['fraction_of_copy']:.0%} of copy bandwidth"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "gpu": props.name,
                    "copy_bytes_per_s": bandwidth,
                    "matmul_flops": matmul_rate,
                    "results": results,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
