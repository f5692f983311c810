"""Builders of LLMServer objects for the operator's unit tests."""

from __future__ import annotations

import copy
from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer

DEFAULT_IMAGES = {"pagekeeper": "registry.test/pagekeeper-engine:1", "vllm": "registry.test/vllm:1"}


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def server_body(spec: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": merge({"model": {"source": "/models/qwen3-0.6b"}}, spec or {}),
    }
    return merge(body, extra)


def make_server(spec: dict[str, Any] | None = None, **extra: Any) -> LLMServer:
    return LLMServer.model_validate(server_body(spec, **extra))
