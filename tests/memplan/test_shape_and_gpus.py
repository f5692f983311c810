"""Reading config.json shapes, the catalogue and GPU products."""

from __future__ import annotations

import pytest

from pagekeeper_memplan.gpus import MiB, gpu_from_labels, parse_product, smallest
from pagekeeper_memplan.shape import (
    ShapeError,
    catalogue_key,
    known_shape,
    num_parameters,
    parse_shape,
    split_error,
)


def test_defaults_follow_the_engines_reading() -> None:
    shape = parse_shape(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "my-llama",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
    )
    assert (shape.arch, shape.num_kv_heads, shape.head_dim) == ("llama", 4, 16)
    assert (shape.max_position_embeddings, shape.tie_word_embeddings) == (2048, False)
    assert (shape.attention_bias, shape.has_qk_norm) == (False, False)


def test_qwen2_has_a_bias_and_qwen3_a_qk_norm() -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert parse_shape({**base, "model_type": "qwen2"}).attention_bias
    assert parse_shape({**base, "model_type": "qwen3"}).has_qk_norm


def test_a_missing_field_is_named() -> None:
    with pytest.raises(ShapeError, match=r"cfg.json: missing required field 'hidden_size'"):
        parse_shape({"model_type": "llama", "num_attention_heads": 2}, source="cfg.json")
    with pytest.raises(ShapeError, match="model_type 'gpt2' is not one of"):
        parse_shape({"model_type": "gpt2"})


@pytest.mark.parametrize(
    ("source", "key", "billions"),
    [
        ("/models/Qwen3-0.6B", "qwen3-0.6b", 0.596),
        ("Qwen/Qwen3-8B", "qwen3-8b", 8.191),
        ("/models/Llama-3.1-8B-Instruct/", "llama-3.1-8b", 8.030),
        ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b", 70.554),
        ("/m/Llama-3.2-1B", "llama-3.2-1b", 1.236),
        ("Qwen/Qwen3-32B", "qwen3-32b", 32.762),
    ],
)
def test_catalogue_names_and_parameter_counts(source: str, key: str, billions: float) -> None:
    # The published parameter counts: 0.6B, 8.2B, 8.0B, 70.6B, 1.24B, 32.8B.
    assert catalogue_key(source) == key
    shape = known_shape(source)
    assert shape is not None
    assert round(num_parameters(shape) / 1e9, 3) == billions


def test_an_unknown_source_has_no_shape() -> None:
    assert known_shape("/models/my-finetune") is None


def test_split_errors_name_the_shape() -> None:
    qwen3 = known_shape("Qwen3-0.6B")
    qwen25 = known_shape("Qwen2.5-7B-Instruct")
    assert qwen3 is not None and qwen25 is not None
    assert split_error(qwen3, 16) is None  # 8 KV heads, each on two ranks
    assert split_error(qwen25, 8) == "28 attention heads do not split evenly over 8 ranks"
    assert split_error(qwen25, 2) is None


@pytest.mark.parametrize(
    ("name", "expected", "mib", "fp8"),
    [
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB", 81559, True),
        ("H100-80GB", "H100-80GB", 81559, True),
        ("h200", "H200-141GB", 143771, True),
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB", 40960, False),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, False),
        ("NVIDIA-L40S", "L40S", 46068, True),
        ("NVIDIA-L4", "L4", 23034, True),
        ("NVIDIA-A10G", "A10G", 23028, False),
        ("NVIDIA-B200", "B200", 183359, True),
    ],
)
def test_products(name: str, expected: str, mib: int, fp8: bool) -> None:
    gpu = parse_product(name)
    assert gpu is not None
    assert (gpu.name, gpu.memory_bytes, gpu.supports_fp8) == (expected, mib * MiB, fp8)


def test_unknown_products_and_mig_slices() -> None:
    assert parse_product("NVIDIA-GeForce-RTX-4090") is None
    assert parse_product("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb") is None


def test_labels_memory_wins_and_the_smallest_gpu_is_assumed() -> None:
    h100 = gpu_from_labels(
        {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81000"}
    )
    assert h100 is not None
    assert (h100.name, h100.memory_bytes, h100.capability) == (
        "NVIDIA-H100-80GB-HBM3",
        81000 * MiB,
        (9, 0),
    )
    odd = gpu_from_labels({"nvidia.com/gpu.memory": "24000"})
    assert odd is not None
    assert (odd.memory_bytes, odd.supports_fp8) == (24000 * MiB, None)
    a100 = gpu_from_labels({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"})
    assert gpu_from_labels({}) is None
    assert smallest([h100, odd, a100] if a100 else []) == odd
