"""The per-rank budget arithmetic of tensor parallelism: each rank's own terms, the smallest
block count for all, and a refusal that names each failing rank with its terms."""

from __future__ import annotations

import dataclasses

import pytest

from pagekeeper_engine.memory.budget import (
    GiB,
    KVLayout,
    MemoryBudgetError,
    MemoryMeasurements,
    MiB,
    combine_rank_budgets,
    compute_budget,
)

# Llama-3.1-70B at TP 4 on 80 GiB cards: 80 layers, 8 KV heads over 4 ranks (2 each),
# head_dim 128, bf16, 16-token blocks.
LAYOUT = KVLayout(num_layers=80, num_kv_heads=2, head_dim=128, block_size=16, dtype_bytes=2)
RANK = MemoryMeasurements(
    total=80 * GiB,
    free_at_start=79 * GiB,
    weights=int(32.9 * GiB),
    peak_activations=2 * GiB,
    non_torch=700 * MiB,
    warmup_fragmentation=80 * MiB,
)


def budget(**changes: int) -> object:
    return compute_budget(dataclasses.replace(RANK, **changes), LAYOUT, 0.9, "auto", 8192)


def test_each_rank_keeps_its_terms_and_all_take_the_smallest_count() -> None:
    # rank 2 holds 1000 MiB more outside the allocator (a bigger CUDA context, say)
    outcomes = [budget(), budget(), budget(non_torch=1700 * MiB), budget()]
    combined = combine_rank_budgets(outcomes)  # type: ignore[arg-type]
    per_rank = [b.num_blocks for b in combined.per_rank]
    assert per_rank[0] == per_rank[1] == per_rank[3]
    # 1000 MiB less for the cache: 1000 MiB / (2 x 80 layers x 16 x 2 heads x 128 x 2 bytes)
    assert per_rank[0] - per_rank[2] == 1000 * MiB // LAYOUT.bytes_per_block == 800
    assert combined.num_blocks == per_rank[2]
    assert combined.limiting_rank == 2
    assert combined.terms[2]["non_torch"] == 1700 * MiB
    assert combined.terms[0]["non_torch"] == 700 * MiB
    assert [t["weights"] for t in combined.terms] == [int(32.9 * GiB)] * 4


def test_a_failing_rank_refuses_the_engine_by_name_with_every_term() -> None:
    failing = "the KV cache holds 3 blocks ... (total=80.00 GiB, weights=75.00 GiB)"
    with pytest.raises(MemoryBudgetError) as raised:
        combine_rank_budgets([budget(), failing, budget(), failing])  # type: ignore[list-item]
    assert str(raised.value) == f"rank 1: {failing}; rank 3: {failing}"


def test_one_rank_passes_its_refusal_on_unchanged() -> None:
    with pytest.raises(MemoryBudgetError) as raised:
        combine_rank_budgets(["the GPU has 1.00 GiB free"])
    assert str(raised.value) == "the GPU has 1.00 GiB free"
