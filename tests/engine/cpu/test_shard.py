"""How a checkpoint splits over tensor-parallel ranks: exact slices, replicated KV heads,
vocabulary padding, and refusals that name the shape that does not split."""

from __future__ import annotations

import dataclasses

import pytest

from pagekeeper_engine.model.shard import ShardError, ShardPlan, TensorSlice
from tests.engine.shapes import LLAMA_8B

LAYER = "model.layers.3"


def test_rank_slices_of_every_split_tensor() -> None:
    plan = ShardPlan.for_rank(LLAMA_8B, 1, 4)
    assert plan.slice_of(f"{LAYER}.self_attn.q_proj.weight") == TensorSlice(0, 1024, 2048, 4096)
    assert plan.slice_of(f"{LAYER}.self_attn.k_proj.weight") == TensorSlice(0, 256, 512, 1024)
    assert plan.slice_of(f"{LAYER}.self_attn.v_proj.weight") == TensorSlice(0, 256, 512, 1024)
    assert plan.slice_of(f"{LAYER}.self_attn.o_proj.weight") == TensorSlice(1, 1024, 2048, 4096)
    assert plan.slice_of(f"{LAYER}.mlp.gate_proj.weight") == TensorSlice(0, 3584, 7168, 14336)
    assert plan.slice_of(f"{LAYER}.mlp.up_proj.weight") == TensorSlice(0, 3584, 7168, 14336)
    assert plan.slice_of(f"{LAYER}.mlp.down_proj.weight") == TensorSlice(1, 3584, 7168, 14336)
    assert plan.slice_of("model.embed_tokens.weight") == TensorSlice(0, 32064, 64128, 128256)
    assert plan.slice_of("lm_head.weight") == TensorSlice(0, 32064, 64128, 128256)
    for replicated in ("model.norm.weight", f"{LAYER}.input_layernorm.weight"):
        assert plan.slice_of(replicated) is None
    local = plan.local_config
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 2, 3584)
    assert (local.vocab_size, local.hidden_size) == (32064, 4096)


def test_biases_follow_their_rows_and_size_one_splits_nothing() -> None:
    qwen2 = dataclasses.replace(LLAMA_8B, attention_bias=True)
    plan = ShardPlan.for_rank(qwen2, 3, 4)
    assert plan.slice_of(f"{LAYER}.self_attn.q_proj.bias") == TensorSlice(0, 3072, 4096, 4096)
    assert plan.slice_of(f"{LAYER}.self_attn.k_proj.bias") == TensorSlice(0, 768, 1024, 1024)
    assert ShardPlan.for_rank(LLAMA_8B, 0, 1).slice_of(f"{LAYER}.mlp.down_proj.weight") is None


def test_fewer_kv_heads_than_ranks_replicates_each_on_consecutive_ranks() -> None:
    two_kv = dataclasses.replace(LLAMA_8B, num_kv_heads=2)
    starts = [ShardPlan.for_rank(two_kv, rank, 8).kv_head_start for rank in range(8)]
    assert starts == [0, 0, 0, 0, 1, 1, 1, 1]
    plan = ShardPlan.for_rank(two_kv, 5, 8)
    assert plan.num_kv_heads == 1 and plan.num_heads == 4
    assert plan.slice_of(f"{LAYER}.self_attn.k_proj.weight") == TensorSlice(0, 128, 256, 256)
    # rank 5's query heads 20..23 are in the second half: the half that reads KV head 1
    assert plan.num_heads * 5 // (two_kv.num_heads // two_kv.num_kv_heads) == 1


def test_the_last_vocabulary_shard_is_padded() -> None:
    odd = dataclasses.replace(LLAMA_8B, vocab_size=97)
    shards = [ShardPlan.for_rank(odd, rank, 4) for rank in range(4)]
    assert [s.vocab_shard for s in shards] == [25] * 4
    assert [s.slice_of("lm_head.weight") for s in shards] == [
        TensorSlice(0, 0, 25, 97),
        TensorSlice(0, 25, 50, 97),
        TensorSlice(0, 50, 75, 97),
        TensorSlice(0, 75, 97, 97),  # 22 rows; 3 rows of zero padding
    ]


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({"num_heads": 14}, 4, "14 attention heads do not split evenly over 4 ranks"),
        ({"num_kv_heads": 3, "num_heads": 24}, 4, "3 KV heads neither split evenly over 4 ranks"),
        ({"intermediate_size": 3004}, 8, "the MLP's 3004 columns do not split evenly over 8"),
        ({"vocab_size": 3}, 4, "a vocabulary of 3 is smaller than 4 ranks"),
    ],
)
def test_shapes_that_do_not_split_are_refused_by_name(
    changes: dict[str, int], size: int, message: str
) -> None:
    with pytest.raises(ShardError, match=f"--tensor-parallel-size {size}: {message}"):
        ShardPlan.for_rank(dataclasses.replace(LLAMA_8B, **changes), 0, size)
