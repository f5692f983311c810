"""A model's shape from its Hugging Face `config.json`, and its weight bytes on one rank.

This is the engine's shape too: its `ModelConfig` (`pagekeeper_engine/model/hf_config.py`)
extends `ModelShape` and is read by `parse_shape`: heads default to the attention heads,
`head_dim` to hidden / heads, `max_position_embeddings` to 2048, Qwen2 always carries a q/k/v
bias and Qwen3 a q/k norm. `RankShape` and `split_error` are the engine's split over
tensor-parallel ranks (`model/shard.py` uses them): q/k/v and gate/up keep a slice of their
output rows, o and down a slice of their input columns, KV heads split evenly or (fewer of them
than ranks) are replicated, the embedding and LM head hold `ceil(vocab / ranks)` rows each (the
last shard padded), norms and biases of row-parallel projections are whole on every rank.

`CATALOGUE` holds the published `config.json` shapes of well-known checkpoints, so a plan needs
no download when the model source names one of them (`known_shape`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The paged engine runs these; vLLM also runs Mistral's, whose shape is Llama's.
ENGINE_ARCHS = ("llama", "qwen2", "qwen3")
ARCHS = (*ENGINE_ARCHS, "mistral")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ROTARY_TABLE_BYTES = 4  # the cos and sin tables are fp32 (model/layers.py RotaryEmbedding)


class ShapeError(ValueError):
    """A config the plan cannot read; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of one decoder-only checkpoint that memory depends on."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry a bias (Qwen2)
    has_qk_norm: bool  # RMSNorm over each head of q and k (Qwen3)
    torch_dtype: str | None = None  # as config.json states it, or None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def detect_arch(raw: dict[str, Any], archs: Sequence[str] = ARCHS) -> str | None:
    """Which of `archs` a config.json object describes: its model_type, else (a fine-tune that
    renamed model_type but kept the class, e.g. a Llama clone) its architectures' class name;
    None when neither names one. The engine asks with the architectures it runs."""
    model_type = raw.get("model_type")
    if model_type in archs:
        return str(model_type)
    for name in raw.get("architectures") or []:
        lowered = str(name).lower()
        for arch in archs:
            if lowered.startswith(arch) and lowered.endswith("forcausallm"):
                return arch
    return None


def _arch(raw: dict[str, Any]) -> str:
    arch = detect_arch(raw)
    if arch is None:
        raise ShapeError(f"model_type {raw.get('model_type')!r} is not one of {', '.join(ARCHS)}")
    return arch


def parse_shape(raw: dict[str, Any], source: str = "config.json") -> ModelShape:
    """The shape of a config.json object; ShapeError names `source` and the field."""
    try:
        arch = _arch(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
        shape = ModelShape(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            has_qk_norm=arch == "qwen3",
            torch_dtype=str(torch_dtype) if torch_dtype is not None else None,
        )
    except KeyError as exc:
        raise ShapeError(f"{source}: missing required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{source}: {exc}") from exc
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        if getattr(shape, name) < 1:
            raise ShapeError(f"{source}: {name} must be at least 1")
    if shape.num_heads % shape.num_kv_heads:
        raise ShapeError(
            f"{source}: num_attention_heads {num_heads} is not a multiple of "
            f"num_key_value_heads {num_kv_heads}"
        )
    return shape


def split_error(shape: ModelShape, tp: int) -> str | None:
    """Why `tp` ranks cannot split the model (the engine's `check_divisible`), or None."""
    if shape.num_heads % tp:
        return f"{shape.num_heads} attention heads do not split evenly over {tp} ranks"
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither split evenly over {tp} ranks nor replicate onto them"
    if shape.intermediate_size % tp:
        return f"the MLP's {shape.intermediate_size} columns do not split evenly over {tp} ranks"
    if shape.vocab_size < tp:
        return f"a vocabulary of {shape.vocab_size} is smaller than {tp} ranks"
    return None


@dataclass(frozen=True)
class RankShape:
    """What one of `tp` ranks holds of a model (the engine's `ShardPlan.local_config`)."""

    model: ModelShape
    tp: int

    @property
    def num_heads(self) -> int:
        return self.model.num_heads // self.tp

    @property
    def num_kv_heads(self) -> int:
        return max(self.model.num_kv_heads // self.tp, 1)

    @property
    def intermediate_size(self) -> int:
        return self.model.intermediate_size // self.tp

    @property
    def vocab_shard(self) -> int:
        return math.ceil(self.model.vocab_size / self.tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.model.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.model.head_dim


@dataclass(frozen=True)
class RankParameters:
    """Elements of one rank's tensors: the decoder layers' projection weights (what FP8
    quantizes, as vLLM's FP8 does: the embedding and LM head stay in the model's dtype), the
    rest in the model's dtype (embedding, LM head, norms, biases), and the fp32 rotary tables."""

    linear: int
    linear_rows: int  # output rows of the projection weights: one fp32 scale each under FP8
    other: int
    rotary: int  # fp32 elements

    @property
    def num_model_dtype(self) -> int:
        return self.linear + self.other


def rank_parameters(shape: ModelShape, tp: int, max_position: int) -> RankParameters:
    """Elements of rank 0's tensors, as the engine's `CausalLM` allocates them for a context of
    `max_position` tokens (every rank holds the same amounts: the vocabulary shard is padded)."""
    rank = RankShape(shape, tp)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    qkv_rows = rank.q_size + 2 * rank.kv_size
    mlp = rank.intermediate_size
    # qkv (fused), o, gate_up (fused), down
    linear = hidden * qkv_rows + rank.q_size * hidden + hidden * 2 * mlp + mlp * hidden
    linear_rows = qkv_rows + hidden + 2 * mlp + hidden
    other = 2 * hidden  # input and post-attention norms
    if shape.attention_bias:
        other += qkv_rows
    if shape.has_qk_norm:
        other += 2 * head_dim
    embedding = rank.vocab_shard * hidden
    lm_head = 0 if shape.tie_word_embeddings else rank.vocab_shard * hidden
    return RankParameters(
        linear=shape.num_layers * linear,
        linear_rows=shape.num_layers * linear_rows,
        other=shape.num_layers * other + embedding + lm_head + hidden,  # + the final norm
        rotary=2 * max_position * (head_dim // 2),
    )


def num_parameters(shape: ModelShape) -> int:
    """The checkpoint's parameter count (one rank, no padding, no rotary tables)."""
    params = rank_parameters(shape, 1, 0)
    return params.linear + params.other


def _llama(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, **kw: Any
) -> ModelShape:
    fields: dict[str, Any] = {
        "arch": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "has_qk_norm": False,
        "torch_dtype": "bfloat16",
    }
    fields.update(kw)
    fields["attention_bias"] = fields["arch"] == "qwen2"
    return ModelShape(**fields)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tie: bool) -> ModelShape:
    return _llama(
        151936, hidden, inter, layers, heads, 8, 128, arch="qwen3", has_qk_norm=True,
        max_position_embeddings=40960, tie_word_embeddings=tie,
    )  # fmt: skip


# Published config.json shapes, keyed by the checkpoint's name in lower case.
CATALOGUE: dict[str, ModelShape] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tie=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tie=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tie=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tie=False),
    "qwen2.5-7b": _llama(
        152064, 3584, 18944, 28, 28, 4, 128, arch="qwen2", max_position_embeddings=32768
    ),
    "llama-3.2-1b": _llama(128256, 2048, 8192, 16, 32, 8, 64, tie_word_embeddings=True),
    "llama-3.2-3b": _llama(128256, 3072, 8192, 28, 24, 8, 128, tie_word_embeddings=True),
    "llama-3.1-8b": _llama(128256, 4096, 14336, 32, 32, 8, 128),
    "llama-3.1-70b": _llama(128256, 8192, 28672, 80, 64, 8, 128),
    "llama-3.3-70b": _llama(128256, 8192, 28672, 80, 64, 8, 128),
    "mistral-7b-v0.3": _llama(
        32768, 4096, 14336, 32, 32, 8, 128, arch="mistral", max_position_embeddings=32768
    ),
}
_PREFIXES = ("meta-",)
_SUFFIXES = ("-instruct", "-chat", "-base")


def catalogue_key(source: str) -> str:
    """The catalogue's name for a model source: its last path component (or Hugging Face id's
    name) in lower case, without `Meta-` and `-Instruct`."""
    name = source.rstrip("/").rsplit("/", 1)[-1].lower()
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def known_shape(source: str) -> ModelShape | None:
    """The catalogued shape the source names, or None."""
    return CATALOGUE.get(catalogue_key(source))
