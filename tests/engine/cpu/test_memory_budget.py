"""The start-up budget arithmetic and the allocator readings, without a GPU."""

from __future__ import annotations

import pytest

from pagekeeper_engine.memory.allocator import (
    AllocatorSettings,
    PeriodicReader,
    SnapshotSampler,
    largest_free_block,
    parse_alloc_conf,
    read_alloc_settings,
)
from pagekeeper_engine.memory.budget import (
    MIN_FRAGMENTATION_BUFFER,
    GiB,
    KVLayout,
    MemoryBudgetError,
    MemoryMeasurements,
    MiB,
    check_num_blocks,
    compute_budget,
    fragmentation_buffer,
    num_cpu_kv_blocks,
)

# Llama-3.1-8B on an 80 GiB card: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
MEASURED = MemoryMeasurements(
    total=80 * GiB,
    free_at_start=79 * GiB,
    weights=15 * GiB,
    peak_activations=3 * GiB,
    non_torch=512 * MiB,
    warmup_fragmentation=100 * MiB,
)


def test_bytes_per_block_counts_keys_and_values_in_every_layer() -> None:
    assert LAYOUT.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2 == 2 * MiB


def test_budget_subtracts_every_term() -> None:
    budget = compute_budget(MEASURED, LAYOUT, 0.9, "auto", max_model_len=8192)
    allowed = int(0.9 * 80 * GiB)
    buffer = 200 * MiB  # measured 100 MiB x safety factor 2
    kv = allowed - 15 * GiB - 3 * GiB - 512 * MiB - buffer
    assert budget.allowed == allowed
    assert budget.fragmentation_buffer == buffer
    assert budget.kv_cache == kv
    assert budget.num_blocks == kv // (2 * MiB) == 27_292
    assert budget.terms == {
        "total": 80 * GiB,
        "free_at_start": 79 * GiB,
        "allowed": allowed,
        "weights": 15 * GiB,
        "peak_activations": 3 * GiB,
        "non_torch": 512 * MiB,
        "measured_fragmentation": 100 * MiB,
        "fragmentation_buffer": buffer,
        "kv_cache": kv,
    }


def test_given_buffer_is_used_as_is_and_auto_has_a_floor() -> None:
    assert fragmentation_buffer(100 * MiB, 1 * GiB) == 1 * GiB
    assert fragmentation_buffer(0, "auto") == MIN_FRAGMENTATION_BUFFER
    budget = compute_budget(MEASURED, LAYOUT, 0.9, 1 * GiB, max_model_len=8192)
    assert budget.fragmentation_buffer == 1 * GiB


def test_refuses_when_one_request_cannot_fit_and_names_every_term() -> None:
    tight = MemoryMeasurements(
        total=24 * GiB,
        free_at_start=24 * GiB,
        weights=15 * GiB,
        peak_activations=3 * GiB,
        non_torch=512 * MiB,
        warmup_fragmentation=0,
    )
    with pytest.raises(MemoryBudgetError) as err:
        # allowed 19.2 GiB - 18.5 GiB - 64 MiB buffer leaves 652.8 MiB: 326 blocks of 2 MiB.
        compute_budget(tight, LAYOUT, 0.8, "auto", max_model_len=131_072)
    message = str(err.value)
    assert "holds 326 blocks" in message
    assert "needs 8192" in message
    for term in (
        "total=",
        "free_at_start=",
        "measured_fragmentation=",
        "allowed=",
        "weights=",
        "peak_activations=",
        "non_torch=",
        "fragmentation_buffer=",
        "kv_cache=",
    ):
        assert term in message


def test_refuses_when_the_gpu_has_less_free_than_asked() -> None:
    shared = MemoryMeasurements(**{**MEASURED.__dict__, "free_at_start": 40 * GiB})
    with pytest.raises(MemoryBudgetError, match=r"has 40\.00 GiB free but"):
        compute_budget(shared, LAYOUT, 0.9, "auto", max_model_len=8192)


def test_alloc_settings_name_the_variable_torch_reads() -> None:
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    settings = read_alloc_settings(both)
    assert settings == AllocatorSettings("PYTORCH_ALLOC_CONF", {"expandable_segments": "True"})
    assert settings.describe() == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    assert read_alloc_settings({"PYTORCH_CUDA_ALLOC_CONF": " max_split_size_mb: 512 "}) == (
        AllocatorSettings("PYTORCH_CUDA_ALLOC_CONF", {"max_split_size_mb": "512"})
    )
    assert read_alloc_settings({}).describe() == (
        "PyTorch defaults (neither PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF set)"
    )


def test_periodic_reader_reads_at_most_once_per_interval() -> None:
    now = [100.0]
    reader = PeriodicReader(lambda: now[0], interval_s=1.0, clock=lambda: now[0])
    assert reader.latest is None
    assert reader.maybe_read() == 100.0
    now[0] = 100.9
    assert reader.maybe_read() == 100.0  # not due: the old reading
    now[0] = 101.0
    assert reader.maybe_read() == 101.0
    now[0] = 101.2
    assert reader.read_now() == 101.2  # forced, and the next is due a second after it
    now[0] = 102.1
    assert reader.maybe_read() == 101.2
    assert reader.num_reads == 3


def test_cpu_kv_blocks_and_overrides_must_hold_one_request() -> None:
    fields = {"block_size": 16, "bytes_per_block": 1000}
    assert (
        num_cpu_kv_blocks(max_num_seqs=4, max_model_len=100, host_memory_bytes=10**9, **fields)
        == 25
    )
    # Bounded by a quarter of host memory: 40 blocks of 1000 bytes.
    assert (
        num_cpu_kv_blocks(max_num_seqs=4, max_model_len=600, host_memory_bytes=160_000, **fields)
        == 40
    )
    with pytest.raises(MemoryBudgetError, match="cannot hold one --max-model-len 700"):
        num_cpu_kv_blocks(max_num_seqs=4, max_model_len=700, host_memory_bytes=160_000, **fields)
    assert check_num_blocks(9, 8, 64, "--num-gpu-blocks-override") == 9
    with pytest.raises(MemoryBudgetError) as err:
        check_num_blocks(8, 8, 64, "--num-gpu-blocks-override")
    assert str(err.value) == (
        "--num-gpu-blocks-override 8 leaves 7 usable blocks of 8 tokens; "
        "one --max-model-len 64 request needs 8"
    )


def test_alloc_conf_prefers_the_first_variable_set() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.8"}
    assert parse_alloc_conf(env) == {
        "expandable_segments": "True",
        "garbage_collection_threshold": "0.8",
    }
    assert parse_alloc_conf({}) == {}
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF: cannot parse 'oops'"):
        parse_alloc_conf({"PYTORCH_ALLOC_CONF": "oops"})


def test_largest_free_block_reads_inactive_blocks_only() -> None:
    segments = [
        {
            "blocks": [
                {"size": 4 * MiB, "state": "active_allocated"},
                {"size": 6 * MiB, "state": "inactive"},
            ]
        },
        {
            "blocks": [
                {"size": 20 * MiB, "state": "active_pending_free"},
                {"size": 2 * MiB, "state": "inactive"},
            ]
        },
    ]
    assert largest_free_block(segments) == 6 * MiB
    assert largest_free_block([]) == 0


def test_snapshot_sampler_spends_at_most_its_share_of_time() -> None:
    now = [0.0]
    calls: list[float] = []

    def take() -> int:
        calls.append(now[0])
        now[0] += 0.2  # each snapshot costs 200 ms
        return len(calls)

    sampler = SnapshotSampler(take, max_overhead=0.01, min_interval=5.0, clock=lambda: now[0])
    assert sampler.maybe_sample() == 1
    now[0] += 10.0  # 200 ms / 1% = 20 s must pass before the next snapshot
    assert sampler.maybe_sample() == 1
    now[0] += 10.0
    assert sampler.maybe_sample() == 2
    assert calls == [0.0, 20.2]
    assert sampler.seconds_spent == pytest.approx(0.4)
