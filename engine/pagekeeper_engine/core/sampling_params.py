"""Sampling parameters of one request: plain data, validated by the server before it gets here."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default bound)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    The logits processors (`json_schema`, `logit_bias`, the penalties, `min_p`) and
    `top_logprobs` are off at
    their defaults; a batch whose rows all leave them so samples exactly as if they did not
    exist (`uses_processors`, `runner/logits_processing.py`).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before anything else reads them
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0  # drop tokens below min_p x the likeliest token's probability
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies) prompt and generated tokens
    top_logprobs: int = 0  # alternatives returned beside each sampled token's logprob
    # a JSON schema (as JSON text) every output must match: `response_format`
    json_schema: str | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """The penalties read the sequence's tokens so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @functools.cached_property
    def uses_processors(self) -> bool:
        """Anything beyond the plain pick: a schema, a bias, a penalty, min-p or top alternatives.
        Cached (outside the fields, so neither equality nor the messages see it): every step
        asks it of every sampled row."""
        return self.json_schema is not None or self.uses_processors_beside_schema

    @functools.cached_property
    def uses_processors_beside_schema(self) -> bool:
        """A bias, a penalty, min-p or top alternatives: what a schema's mask alone, which the
        pick reads as it picks, does not ask for. Cached as `uses_processors` is."""
        return (
            bool(self.logit_bias) or self.min_p > 0.0 or self.top_logprobs > 0 or self.has_penalties
        )
