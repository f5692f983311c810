"""Model shapes the tests split and size without any weights."""

from __future__ import annotations

from pagekeeper_engine.model.hf_config import ModelConfig

# Llama-3.1-8B: 32 heads, 8 KV heads, head_dim 128, MLP 14336, vocabulary 128256.
LLAMA_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=None,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    attention_bias=False,
    has_qk_norm=False,
    torch_dtype="bfloat16",
    eos_token_ids=(128001,),
    bos_token_id=128000,
)
