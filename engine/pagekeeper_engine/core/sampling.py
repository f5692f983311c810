"""Sampling parameters of one request: plain data, validated by the server before it gets here."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

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
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
