"""Tiny random-weight Hugging Face checkpoints and a CPU runner over them, shared by the tests.

`make_hf_model` builds a 2-layer model whose every tensor is random (norms near 1), so a wrong
weight mapping changes the logits; `write_checkpoint` saves it with `save_pretrained`;
`make_runner` loads it through the engine's `ModelRunner` on the CPU in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.runner.runner import ModelRunner
from pagekeeper_engine.runner.step_layout import longest_decodes_first

BLOCK_SIZE = 8
TOLERANCE = 1e-4
GREEDY = SamplingParams(temperature=0.0)
_ARCHS: dict[str, tuple[type[Any], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A 2-layer model with GQA (4 query heads, 2 kv heads) and head_dim != hidden / heads."""
    config_cls, model_cls = _ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "attn_implementation": "eager",
    }
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    # Default init leaves biases at 0 and norms at 1; randomise all so every tensor matters.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model


def write_checkpoint(
    path: Path, arch: str, max_shard_size: str | None = None, **overrides: Any
) -> PreTrainedModel:
    model = make_hf_model(arch, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def make_runner(path: Path, num_blocks: int = 24, **overrides: Any) -> ModelRunner:
    fields: dict[str, Any] = {
        "model": str(path),
        "device": "cpu",
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": 64,
        "max_num_seqs": 4,
        "num_gpu_blocks_override": num_blocks,
        "num_cpu_blocks_override": 4,
    }
    fields.update(overrides)
    return ModelRunner(EngineConfig(**fields), progress=False)


def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), V) logits of the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def seq(
    request_id: str, tokens: list[int], start_pos: int, block_ids: list[int], **kw: Any
) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=request_id,
        token_ids=tokens,
        start_pos=start_pos,
        block_ids=block_ids,
        needs_sample=kw.get("needs_sample", True),
        sampling=kw.get("sampling", GREEDY),
        num_output_tokens=kw.get("num_output_tokens", 0),
    )


def step_logits(runner: ModelRunner, seqs: list[ScheduledSeq]) -> list[torch.Tensor]:
    """Run one step through the runner's packing and model; fp32 logits of every row, per
    seq (in `seqs`' order, whatever order the packing gave their rows)."""
    with torch.inference_mode():
        inputs = runner.prepare_inputs(seqs)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.model.compute_logits(hidden).float()
    bounds = inputs.meta.query_start_loc.tolist()
    order = longest_decodes_first(
        np.array([s.num_tokens for s in seqs], np.int64),
        np.array([s.start_pos for s in seqs], np.int64),
    )
    rows = list(range(len(seqs))) if order is None else order.tolist()
    by_seq = {seq_index: row for row, seq_index in enumerate(rows)}
    return [logits[bounds[by_seq[i]] : bounds[by_seq[i] + 1]] for i in range(len(seqs))]


def tokens(n: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 97 for i in range(n)]
