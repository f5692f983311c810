"""--kv-cache-memory-bytes: the flag, the budget arithmetic with exact block counts, and the
CPU runner's pool sized by it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.memory.budget import (
    GiB,
    KVLayout,
    MemoryBudgetError,
    MemoryMeasurements,
    MiB,
    compute_budget,
    num_cpu_kv_blocks,
)
from pagekeeper_memplan.defaults import DEFAULT_GPU_MEMORY_UTILIZATION
from tests.engine.checkpoints import make_runner, write_checkpoint

# Llama-3.1-8B on an 80 GiB card: 2 MiB per 16-token block over its 32 layers.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
MEASURED = MemoryMeasurements(
    total=80 * GiB,
    free_at_start=79 * GiB,
    weights=15 * GiB,
    peak_activations=3 * GiB,
    non_torch=512 * MiB,
    warmup_fragmentation=100 * MiB,
)
BUFFER = 200 * MiB  # the measured 100 MiB x the safety factor 2


def test_the_flag_takes_bytes_or_quantities_and_leaves_the_utilization_at_its_default() -> None:
    config = parse_args(["/m", "--kv-cache-memory-bytes", "20Gi"])
    assert config.kv_cache_memory_bytes == 20 * GiB
    assert config.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    assert parse_args(["/m", "--kv-cache-memory-bytes", "1000000"]).kv_cache_memory_bytes == 10**6
    assert parse_args(["/m", "--gpu-memory-utilization", "0.8"]).kv_cache_memory_bytes is None
    assert parse_args(["/m"]).gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION


def test_the_flag_and_an_explicit_utilization_are_refused_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["/m", "--kv-cache-memory-bytes", "8Gi", "--gpu-memory-utilization", "0.9"])
    assert exit_info.value.code == 2
    assert (
        "argument --kv-cache-memory-bytes: not allowed with --gpu-memory-utilization"
        in capsys.readouterr().err
    )
    for bad in ("0", "lots"):
        with pytest.raises(SystemExit):
            parse_args(["/m", "--kv-cache-memory-bytes", bad])
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_the_kv_cache_is_the_request_in_whole_blocks() -> None:
    requested = 20 * GiB + 3 * MiB  # 10,241.5 blocks of 2 MiB
    budget = compute_budget(
        MEASURED, LAYOUT, 0.9, "auto", max_model_len=8192, kv_cache_memory_bytes=requested
    )
    assert budget.num_blocks == 10_241
    assert budget.kv_cache == requested
    assert budget.kv_cache_allocated == 10_241 * 2 * MiB == requested - 1 * MiB
    assert budget.allowed == 15 * GiB + 3 * GiB + 512 * MiB + BUFFER + requested
    assert budget.terms == {
        "total": 80 * GiB,
        "free_at_start": 79 * GiB,
        "allowed": budget.allowed,
        "weights": 15 * GiB,
        "peak_activations": 3 * GiB,
        "non_torch": 512 * MiB,
        "measured_fragmentation": 100 * MiB,
        "fragmentation_buffer": BUFFER,
        "kv_cache": requested,
        "kv_cache_requested": requested,
    }


def test_the_utilization_is_unused_under_the_request() -> None:
    low = compute_budget(MEASURED, LAYOUT, 0.1, "auto", 8192, kv_cache_memory_bytes=40 * GiB)
    high = compute_budget(MEASURED, LAYOUT, 0.99, "auto", 8192, kv_cache_memory_bytes=40 * GiB)
    assert low == high
    assert low.num_blocks == 20_480
    # Without the request the term is absent: the utilization's budget has no request to show.
    assert "kv_cache_requested" not in compute_budget(MEASURED, LAYOUT, 0.9, "auto", 8192).terms


def test_refuses_a_request_beyond_the_free_memory_naming_every_term() -> None:
    # 79 GiB free - 15 - 3 - 0.5 GiB - 200 MiB leaves 60.3 GiB: 61 GiB does not fit.
    with pytest.raises(MemoryBudgetError) as err:
        compute_budget(MEASURED, LAYOUT, 0.9, "auto", 8192, kv_cache_memory_bytes=61 * GiB)
    message = str(err.value)
    assert message.startswith(
        "the GPU has 79.00 GiB free but --kv-cache-memory-bytes 65498251264 with the other "
        "terms asks for 79.70 GiB of 80.00 GiB"
    )
    assert "lower --kv-cache-memory-bytes" in message
    terms = ("weights=", "peak_activations=", "non_torch=", "fragmentation_buffer=", "kv_cache=")
    for term in terms:
        assert term in message
    fits = compute_budget(MEASURED, LAYOUT, 0.9, "auto", 8192, kv_cache_memory_bytes=60 * GiB)
    assert fits.num_blocks == 30_720


def test_refuses_a_request_that_cannot_hold_one_max_model_len_request() -> None:
    # 8192 tokens need 512 blocks of 16 = 1 GiB; 1 GiB - 1 byte holds 511.
    with pytest.raises(MemoryBudgetError) as err:
        compute_budget(MEASURED, LAYOUT, 0.9, "auto", 8192, kv_cache_memory_bytes=GiB - 1)
    assert "holds 511 blocks of 16 tokens but one --max-model-len 8192 request needs 512" in str(
        err.value
    )
    assert "raise --kv-cache-memory-bytes" in str(err.value)
    exact = compute_budget(MEASURED, LAYOUT, 0.9, "auto", 8192, kv_cache_memory_bytes=GiB)
    assert exact.num_blocks == 512


def test_the_cpu_honours_the_request_as_its_host_budget() -> None:
    fields = {"max_num_seqs": 4, "block_size": 16, "bytes_per_block": 1000}
    # Without the request: every sequence at full length (25 blocks); with it, what it holds.
    assert num_cpu_kv_blocks(max_model_len=100, host_memory_bytes=10**9, **fields) == 25
    assert (
        num_cpu_kv_blocks(
            max_model_len=100, host_memory_bytes=10**9, kv_cache_memory_bytes=99_999, **fields
        )
        == 99
    )
    with pytest.raises(MemoryBudgetError, match=r"--kv-cache-memory-bytes 6999 \(6 blocks"):
        num_cpu_kv_blocks(
            max_model_len=100, host_memory_bytes=10**9, kv_cache_memory_bytes=6999, **fields
        )


def test_the_cpu_runner_allocates_the_requested_blocks(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    # The tiny model: 2 layers x 2 KV heads x head_dim 16 x 8 tokens x k and v x 4 bytes.
    bytes_per_block = 2 * 2 * 2 * 16 * 8 * 4
    requested = 30 * bytes_per_block + bytes_per_block - 1
    runner = make_runner(tmp_path, num_gpu_blocks_override=None, kv_cache_memory_bytes=requested)
    assert runner.bytes_per_block == bytes_per_block
    assert runner.num_gpu_blocks == 30
    assert runner.pools.device_pool.nbytes == 30 * bytes_per_block
    assert 0 <= requested - runner.pools.device_pool.nbytes < bytes_per_block
