"""The plan's exact terms against what the engine itself allocates for the same shapes, and
the one shape model they share (the engine's `ModelConfig` is memplan's `ModelShape`).

Weights: the engine's loader with dummy weights (one rank) and its `CausalLM` built on the meta
device for other ranks and sizes; the step buffers: the engine's workspace, sampler rows and
shard picker; the KV block: the engine's `KVLayout`.
"""

from __future__ import annotations

from dataclasses import astuple, fields
from typing import Any

import pytest
import torch

from pagekeeper_engine.attention.registry import get_backend
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.kernels.pick_scratch import PickScratch
from pagekeeper_engine.model.hf_config import parse_model_config
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.loader import load_model
from pagekeeper_engine.model.shard import ShardError, ShardPlan
from pagekeeper_engine.model.workspace import Workspace, WorkspaceShape
from pagekeeper_engine.runner.kv_cache import kv_layout as engine_kv_layout
from pagekeeper_engine.runner.sampler import SamplerBuffers
from pagekeeper_engine.runner.shard_pick import ShardPicker, VocabShard
from pagekeeper_memplan.activations import (
    sampler_bytes,
    shard_picker_bytes,
    workspace_bytes,
)
from pagekeeper_memplan.plan import PlanInputs, kv_layout, weight_bytes
from pagekeeper_memplan.shape import ModelShape, RankShape, parse_shape, split_error

MAX_POSITION = 64


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": MAX_POSITION,
        "tie_word_embeddings": False,
    }
    raw.update(overrides)
    return raw


def allocated_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nbytes for t in tensors.values())


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    ("qwen3", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_the_engine_runs_the_shape_the_plan_reads(arch: str, overrides: dict[str, Any]) -> None:
    raw = tiny_config(arch, **overrides, torch_dtype="bfloat16")
    config, shape = parse_model_config(raw), parse_shape(raw)
    assert isinstance(config, ModelShape)
    dimensions = {field.name: getattr(config, field.name) for field in fields(ModelShape)}
    assert ModelShape(**dimensions) == shape
    for size in (2, 4):
        plan = ShardPlan.for_rank(config, 0, size)
        rank = RankShape(shape, size)
        assert (plan.num_heads, plan.num_kv_heads, plan.intermediate_size, plan.vocab_shard) == (
            rank.num_heads,
            rank.num_kv_heads,
            rank.intermediate_size,
            rank.vocab_shard,
        )
    reason = "4 attention heads do not split evenly over 8 ranks"
    assert split_error(shape, 8) == reason
    with pytest.raises(ShardError) as refused:
        ShardPlan.for_rank(config, 0, 8)
    assert str(refused.value) == f"--tensor-parallel-size 8: {reason}"


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_weights_equal_the_loaders_dummy_model(arch: str, overrides: dict[str, Any]) -> None:
    raw = tiny_config(arch, **overrides)
    model = load_model(
        parse_model_config(raw),
        "unused",
        load_format="dummy",
        dtype=torch.float32,
        device="cpu",
        backend=get_backend("cpu"),
        max_position=MAX_POSITION,
    )
    planned, _ = weight_bytes(parse_shape(raw), PlanInputs(dtype="float32"), MAX_POSITION)
    assert planned == allocated_bytes(model)


@pytest.mark.parametrize(("arch", "overrides"), CASES)
@pytest.mark.parametrize(("rank", "size"), [(0, 2), (1, 2), (3, 4), (0, 4)])
def test_weights_of_a_rank_equal_the_engines_shard(
    arch: str, overrides: dict[str, Any], rank: int, size: int
) -> None:
    # 4 ranks over 2 KV heads: each KV head replicated on two ranks; 97 rows padded to 4 x 25.
    raw = tiny_config(arch, **overrides)
    with torch.device("meta"):
        model = CausalLM(
            parse_model_config(raw),
            MAX_POSITION,
            get_backend("cpu"),
            torch.bfloat16,
            TensorParallelGroup(rank, size),
        )
    inputs = PlanInputs(tp=size, dtype="bfloat16")
    planned, _ = weight_bytes(parse_shape(raw), inputs, MAX_POSITION)
    assert planned == allocated_bytes(model)


@pytest.mark.parametrize(("arch", "overrides"), CASES)
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 2), (3, 4)])
def test_fp8_weights_of_a_rank_equal_the_engines(
    arch: str, overrides: dict[str, Any], rank: int, size: int
) -> None:
    raw = tiny_config(arch, **overrides)
    with torch.device("meta"):
        model = CausalLM(
            parse_model_config(raw),
            MAX_POSITION,
            get_backend("cpu"),
            torch.bfloat16,
            TensorParallelGroup(rank, size),
            quantization="fp8",  # type: ignore[call-arg]
        )
    inputs = PlanInputs(tp=size, dtype="bfloat16", quantization="fp8")
    planned, _ = weight_bytes(parse_shape(raw), inputs, MAX_POSITION)
    assert planned == allocated_bytes(model)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_bytes_per_block_equal_the_engines_layout(size: int, kv_dtype: str) -> None:
    raw = tiny_config("qwen3")
    local = ShardPlan.for_rank(parse_model_config(raw), 0, size).local_config
    dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16
    inputs = PlanInputs(
        tp=size, dtype="bfloat16", kv_cache_dtype="fp8" if kv_dtype == "fp8" else "auto"
    )
    planned, engine = kv_layout(parse_shape(raw), inputs), engine_kv_layout(local, 16, dtype)
    assert astuple(planned) == astuple(engine)
    assert planned.bytes_per_block == engine.bytes_per_block


@pytest.mark.parametrize(("size", "max_tokens"), [(1, 40), (2, 9000), (4, 8192)])
def test_workspace_equals_the_engines(size: int, max_tokens: int) -> None:
    raw = tiny_config("llama")
    local = ShardPlan.for_rank(parse_model_config(raw), 0, size).local_config
    with torch.device("meta"):
        workspace = Workspace(WorkspaceShape.for_model(local, max_tokens), torch.bfloat16, "meta")
    assert workspace_bytes(parse_shape(raw), size, max_tokens, 2) == workspace.nbytes


@pytest.mark.parametrize(("rows", "vocab"), [(256, 151936), (3, 97), (64, 128256)])
def test_sampler_rows_equal_the_engines(rows: int, vocab: int) -> None:
    buffers = SamplerBuffers(rows, vocab, torch.bfloat16, "meta")
    pick = PickScratch(rows, vocab, "meta")  # allocated on GPUs only
    assert sampler_bytes(vocab, rows, 2) == buffers.nbytes + pick.nbytes
    assert sampler_bytes(vocab, rows, 2, on_gpu=False) == buffers.nbytes


@pytest.mark.parametrize("size", [2, 4])
def test_shard_picker_equals_the_engines(size: int) -> None:
    raw = tiny_config("llama", vocab_size=9001)
    plan = ShardPlan.for_rank(parse_model_config(raw), 0, size)
    picker = ShardPicker(
        32,
        VocabShard.of(plan),
        TensorParallelGroup(0, size),
        seed=0,
        eos_token_ids=frozenset(),
        dtype=torch.bfloat16,
        device="cpu",  # its generator needs a real device
    )
    assert shard_picker_bytes(parse_shape(raw), size, 32, 2) == picker.nbytes
