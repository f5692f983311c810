"""A Hugging Face `config.json` parsed into the typed `ModelConfig` the engine runs: memplan's
`ModelShape` (the dimensions, read the one way the operator's memory plan reads them) and what
only the engine needs (norm epsilon, rotary frequencies, special tokens).

Torch-free on purpose: the tokenizer and the command line read checkpoints without it. Both the
older layout (`rope_theta` + `rope_scaling`, `torch_dtype`) and the newer one (`rope_parameters`,
`dtype`) are accepted, since checkpoints in the wild carry either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pagekeeper_memplan.shape import ENGINE_ARCHS, ModelShape, ShapeError, detect_arch, parse_shape

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(Exception):
    """A checkpoint file is missing, malformed or describes something the engine cannot run.

    The message always names the file, because the reader is whoever prepared the checkpoint.
    """


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched beyond the pre-training context."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelShape):
    """One decoder-only checkpoint the engine runs (Llama, Qwen2 or Qwen3): its shape, whose
    `arch` is one of `ENGINE_ARCHS` and `torch_dtype` "bfloat16", "float16", "float32" or None
    if unstated, and what the engine alone needs to run it."""

    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from a checkpoint file, or raise a CheckpointError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: file not found") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def token_id_list(value: object) -> tuple[int, ...]:
    """`eos_token_id` may be absent, one id, or a list of ids."""
    if value is None:
        return ()
    if isinstance(value, bool):
        raise TypeError("token id must be an integer")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise TypeError(f"token id must be an integer or a list of integers, got {value!r}")


def load_eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """End-of-sequence ids named by generation_config.json and config.json (either optional)."""
    eos_ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            try:
                eos_ids.update(token_id_list(read_json(path).get("eos_token_id")))
            except TypeError as exc:
                raise CheckpointError(f"{path}: eos_token_id: {exc}") from exc
    return frozenset(eos_ids)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json`."""
    path = Path(model_dir) / "config.json"
    return parse_model_config(read_json(path), source=str(path))


def _arch(raw: dict[str, Any]) -> str:
    arch = detect_arch(raw, ENGINE_ARCHS)
    if arch is None:
        raise ValueError(
            f"model_type {raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(ENGINE_ARCHS)})"
        )
    return arch


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
    else:
        theta = float(raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling is None and isinstance(params, dict):
        scaling = params
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate a config.json object; `source` names the file in every error. The shape (sizes,
    heads, the Qwen quirks) is `pagekeeper_memplan.shape`'s reading, the one the operator's
    memory plan makes; the rest is what only the engine needs."""
    try:
        arch = _arch(raw)
        shape = parse_shape(raw, source)
        rope_theta, rope_scaling = _rope(raw)
        torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
        if torch_dtype is not None and torch_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype {torch_dtype!r} is not supported")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        dimensions = {field.name: getattr(shape, field.name) for field in fields(ModelShape)}
        config = ModelConfig(
            **{**dimensions, "arch": arch, "torch_dtype": torch_dtype},
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            eos_token_ids=token_id_list(raw.get("eos_token_id")),
            bos_token_id=token_id_list(raw.get("bos_token_id"))[0]
            if raw.get("bos_token_id") is not None
            else None,
        )
    except ShapeError as exc:  # it names the source already
        raise CheckpointError(str(exc)) from exc
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is not supported")
    return config
