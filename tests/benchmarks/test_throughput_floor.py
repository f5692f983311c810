"""W-nano's physical floor: a tensor-parallel rank's share of the bytes and FLOPs."""

from __future__ import annotations

import pytest

from benchmarks.offline_engine import physical_floor, w_nano
from benchmarks.shapes import ONE_GPU_SHAPES, SHAPES, kv_bytes_per_token, weight_bytes_per_step

BANDWIDTH, RATE = 4.0e12, 8.0e14


def test_two_ranks_each_carry_half_the_work() -> None:
    cfg, work = SHAPES["llama-3.1-8b"], w_nano()
    one = physical_floor(cfg, work, BANDWIDTH, RATE)
    assert physical_floor(cfg, work, BANDWIDTH, RATE, tensor_parallel_size=2) == pytest.approx(
        one / 2, rel=1e-12
    )


def test_kv_heads_do_not_split_below_one_a_rank() -> None:
    # 8 KV heads over 16 ranks: each rank still reads a whole head, twice its 1/16 share.
    cfg, work = SHAPES["llama-3.1-8b"], w_nano()
    kv_only = {**cfg, "num_hidden_layers": 0, "vocab_size": 0}  # no weights, no FLOPs
    assert physical_floor(kv_only, work, BANDWIDTH, RATE) == 0.0
    with_kv = {**cfg, "hidden_size": 0, "intermediate_size": 0, "vocab_size": 0}
    no_flops = float("inf")  # the prefill's attention FLOPs do split 16 ways
    one = physical_floor(with_kv, work, BANDWIDTH, no_flops)
    sixteen = physical_floor(with_kv, work, BANDWIDTH, no_flops, tensor_parallel_size=16)
    assert one > 0 and sixteen == pytest.approx(one / 8, rel=1e-12)


def test_the_70b_shape_reads_its_parameters_a_step() -> None:
    # Llama-3.1-70B: 70.6 B parameters, of which the input embedding (1.05 B) is not read by a
    # decode step beyond its one row; 139 GB of bf16 a step, a quarter a rank at TP 4.
    read = weight_bytes_per_step(SHAPES["llama-3.1-70b"])
    assert 69.4e9 < read / 2 < 69.6e9
    assert set(ONE_GPU_SHAPES) < set(SHAPES) and "llama-3.1-70b" not in ONE_GPU_SHAPES


def test_a_tokens_kv_bytes_per_rank() -> None:
    cfg = SHAPES["llama-3.1-8b"]  # 32 layers, keys and values, 8 heads of 128
    assert kv_bytes_per_token(cfg) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(cfg, kv_element_bytes=1) == 2 * 32 * 8 * 128
    assert kv_bytes_per_token(cfg, tensor_parallel_size=2) == 2 * 32 * 4 * 128 * 2
    # more ranks than KV heads: each rank still holds one whole head
    assert kv_bytes_per_token(cfg, tensor_parallel_size=16) == 2 * 32 * 1 * 128 * 2
