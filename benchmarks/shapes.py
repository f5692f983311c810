"""The model shapes the benchmarks run at: each a Hugging Face `config.json` as a dict.

With `--load-format dummy` the engine builds random weights at exactly this shape, which costs
what real weights cost (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# What every Llama 3.1 size shares: its vocabulary, 8 KV heads of 128, the llama3 rope scaling.
_LLAMA_3_1: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        **_LLAMA_3_1,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    # 141 GB of bf16 weights: the tensor-parallel runs' shape (`--tensor-parallel-size 4`).
    "llama-3.1-70b": {
        **_LLAMA_3_1,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}
# What `--shape all` runs: the shapes whose weights fit one GPU.
ONE_GPU_SHAPES = ("qwen3-0.6b", "llama-3.1-8b")


def weight_bytes_per_step(cfg: dict[str, Any]) -> int:
    """Weights a decode step must read: every layer's matrices and the LM head (bf16)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_size = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_size = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    return 2 * int(cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * hidden)


def prefill_flops(cfg: dict[str, Any], prompt_lens: Iterable[int]) -> float:
    """FLOPs to prefill prompts of these lengths from scratch: every layer's matmuls for each
    token (not the LM head, which runs once per prompt) and causal attention."""
    lens = list(prompt_lens)
    matmul_params = weight_bytes_per_step(cfg) // 2 - cfg["vocab_size"] * cfg["hidden_size"]
    attention = (
        sum(n**2 for n in lens)
        * 2
        * cfg["num_attention_heads"]
        * cfg["head_dim"]
        * cfg["num_hidden_layers"]
    )  # 2 matmuls x 2 FLOPs x L^2 / 2, causal
    return float(2 * matmul_params * sum(lens) + attention)


def kv_bytes_per_token(
    cfg: dict[str, Any], kv_element_bytes: int = 2, tensor_parallel_size: int = 1
) -> int:
    """One token's keys and values in every layer, on one rank (its KV heads, at least one)."""
    kv_heads = -(-cfg["num_key_value_heads"] // tensor_parallel_size)
    return 2 * cfg["num_hidden_layers"] * kv_heads * cfg["head_dim"] * kv_element_bytes
