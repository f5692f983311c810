"""The Llama-family decoder (Llama, Qwen2, Qwen3): config parsing, layers and weight loading.

Importing this package does not import torch; `model.llama`, `model.layers`,
`model.paged_attention` and `model.loader` do.
"""

from pagekeeper_engine.model.hf_config import (
    CheckpointError,
    ModelConfig,
    RopeScaling,
    load_model_config,
)

__all__ = ["CheckpointError", "ModelConfig", "RopeScaling", "load_model_config"]
