from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagekeeper_engine.attention.base import AttentionMetadata, KVScales
from pagekeeper_engine.attention.torch_ref import TorchRefBackend
from pagekeeper_engine.model.hf_config import (
    CheckpointError,
    RopeScaling,
    load_model_config,
    parse_model_config,
)
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.loader import ProgressBar, load_model, resolve_dtype
from tests.engine.checkpoints import write_checkpoint

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
}


def load(path: Path, load_format: str = "auto", **kw: Any) -> CausalLM:
    config = load_model_config(path)
    return load_model(
        config,
        path,
        load_format=load_format,
        dtype=kw.get("dtype", torch.float32),
        device="cpu",
        backend=TorchRefBackend(),
        max_position=32,
        seed=kw.get("seed", 0),
        progress=False,
    )


def test_defaults_and_older_config_layout() -> None:
    raw = {
        **BASE,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
        "eos_token_id": [7, 9],
    }
    config = parse_model_config(raw)
    assert (config.head_dim, config.num_kv_heads, config.q_size, config.kv_size) == (8, 2, 64, 16)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert (config.torch_dtype, config.eos_token_ids) == ("bfloat16", (7, 9))
    assert not config.attention_bias and not config.has_qk_norm and not config.tie_word_embeddings


def test_newer_config_layout_and_arch_features() -> None:
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = parse_model_config({**BASE, "rope_parameters": llama3, "dtype": "float16"})
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.torch_dtype == "float16"
    default = {"rope_type": "default", "rope_theta": 1e6}
    qwen3 = parse_model_config({**BASE, "model_type": "qwen3", "rope_parameters": default})
    assert (qwen3.rope_theta, qwen3.rope_scaling, qwen3.has_qk_norm) == (1e6, None, True)
    assert parse_model_config({**BASE, "model_type": "qwen2"}).attention_bias


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_bad_config_is_refused_naming_the_file(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(CheckpointError, match=message) as info:
        parse_model_config(raw, source="/ckpt/config.json")
    assert str(info.value).startswith("/ckpt/config.json: ")


def test_missing_and_malformed_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        load_model_config(tmp_path)


def test_dummy_weights_at_real_shape_seeded(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_key_value_heads": 4}))
    first = load(tmp_path, "dummy", seed=1)
    again = load(tmp_path, "dummy", seed=1)
    other = load(tmp_path, "dummy", seed=2)
    shapes = first.checkpoint_shapes()
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, 64)
    assert shapes["lm_head.weight"] == (100, 64)
    assert len(shapes) == 2 + 2 * 9 + 1  # embed, norm; 9 per layer; lm_head
    qkv = first.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    assert qkv.shape == (64 + 2 * 32, 64) and qkv.abs().max() <= 1e-3 and qkv.std() > 1e-4
    assert first.get_parameter("model.norm.weight").eq(1).all()
    for (_, a), (_, b), (_, c) in zip(
        first.named_parameters(), again.named_parameters(), other.named_parameters(), strict=True
    ):
        assert torch.equal(a, b)
        assert a.eq(1).all() or not torch.equal(a, c)


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert resolve_dtype("auto", "float16", "cuda") == torch.float16
    assert resolve_dtype("auto", "float32", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", None, "cuda:1") == torch.bfloat16
    assert resolve_dtype("bfloat16", "float32", "cpu") == torch.bfloat16


def test_loads_checkpoint_in_requested_dtype(tmp_path: Path) -> None:
    hf = write_checkpoint(tmp_path, "qwen2")
    model = load(tmp_path, dtype=torch.bfloat16)
    bias = model.get_parameter("model.layers.1.self_attn.qkv_proj.bias")
    assert bias.dtype == torch.bfloat16
    hf_attn = hf.model.layers[1].self_attn
    expected = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(bias, expected.to(torch.bfloat16))


def test_missing_weights_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors.*--load-format dummy"):
        load(tmp_path)


def test_corrupt_safetensors_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama", max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{victim.name}: shard listed in .*index\.json"):
        load(tmp_path)


def test_missing_wrong_shape_and_unknown_tensors_are_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    good = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(
        CheckpointError,
        match=r"1 tensors missing from model\.safetensors: "
        r"model\.layers\.1\.mlp\.up_proj\.weight",
    ):
        load(tmp_path)
    save_file({**good, "model.norm.weight": torch.ones(5)}, path)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.norm\.weight' "
        r"has shape \(5,\), expected \(32,\)",
    ):
        load(tmp_path)
    save_file({**good, "model.layers.0.mlp.experts.weight": torch.ones(2)}, path)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp"
        r"\.experts\.weight' is not part of a llama model",
    ):
        load(tmp_path)


def test_tied_checkpoint_may_still_carry_lm_head(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": torch.zeros(97, 32)}, path)
    model = load(tmp_path)
    assert model.lm_head is None
    assert torch.equal(model.lm_head_weight, tensors["model.embed_tokens.weight"])


def test_kv_scales_of_an_fp8_checkpoint_are_read_per_layer(tmp_path: Path) -> None:
    """vLLM's names: `self_attn.k_scale` and `v_scale`, or one `kv_scale` for both."""
    write_checkpoint(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    good = load_file(path)
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([2.0]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(3.0),
    }
    save_file({**good, **scales}, path)
    assert load(tmp_path).checkpoint_kv_scales == [(0.5, 2.0), (3.0, 3.0)]
    save_file(good, path)
    assert load(tmp_path).checkpoint_kv_scales == [(1.0, 1.0), (1.0, 1.0)]
    save_file({**good, "model.layers.1.self_attn.k_scale": torch.tensor(-1.0)}, path)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: model\.layers\.1\.self_attn\.k_scale must be one positive "
        r"number, got shape \(\) value -1\.0",
    ):
        load(tmp_path)
    save_file({**good, "model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, path)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.7\.self_attn\.k_scale' is not"):
        load(tmp_path)


def test_the_reference_backend_stores_over_the_scales_and_attends_alike() -> None:
    """Scaled writes hold value / scale; attention over them equals the unscaled result."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 16, generator=gen) for h in (4, 2, 2))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(5, dtype=torch.int64),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        max_query_len=5,
        max_seq_len=5,
        num_decode_seqs=0,
    )
    caches = [torch.zeros(1, 8, 2, 16) for _ in range(4)]
    backend = TorchRefBackend()
    plain = backend.forward(q, k, v, caches[0], caches[1], meta, 0.25)
    scaled = backend.forward(q, k, v, caches[2], caches[3], meta, 0.25, None, KVScales(4.0, 0.5))
    assert torch.allclose(caches[2][0, :5], k / 4.0) and torch.allclose(caches[3][0, :5], v / 0.5)
    assert torch.allclose(scaled, plain, atol=1e-5)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar() -> None:
    plain = io.StringIO()
    bar = ProgressBar(8, "loading weights", stream=plain)
    for _ in range(8):
        bar.update()
    lines = plain.getvalue().splitlines()
    assert [line.split("| ")[1].split()[0] for line in lines] == ["1/8", "2/8", "4/8", "6/8", "8/8"]
    assert lines[-1].startswith("loading weights |" + "#" * 30 + "|")
    terminal = _Terminal()
    bar = ProgressBar(3, "w", stream=terminal)
    for _ in range(3):
        bar.update()
    assert terminal.getvalue().startswith("\rw |##########")
    last = terminal.getvalue().rsplit("\r", 1)[1]
    assert last.startswith("w |" + "#" * 30 + "| 3/3 ") and last.endswith("s\n")
