"""What the scheduler may take: its configured limits and whether a prompt can ever run.

Pure Python; never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.kv_manager import num_blocks_for
from pagekeeper_memplan.defaults import resolve_max_num_batched_tokens


class RequestRejectedError(ValueError):
    """A request this engine can never serve as configured (the server answers 400, naming
    `param` where the fault is in one field, else the prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EngineLimits:
    """The limits every part of the engine works within, resolved once from the flags and the
    model (`resolve_limits`): the runner sizes its buffers by them, the scheduler schedules
    within them and the front ends validate requests against them."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_num_in_flight: int  # running slots plus the bounded waiting queue


def resolve_limits(config: EngineConfig, model_max_len: int) -> EngineLimits:
    """`--max-model-len` (default: the model's context, never beyond it) and the step budget
    that follows from it (see `resolve_max_num_batched_tokens`)."""
    max_model_len = config.max_model_len if config.max_model_len is not None else model_max_len
    if max_model_len > model_max_len:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's "
            f"max_position_embeddings of {model_max_len}"
        )
    return EngineLimits(
        max_model_len=max_model_len,
        max_num_batched_tokens=resolve_max_num_batched_tokens(
            config.max_num_batched_tokens, config.enable_chunked_prefill, max_model_len
        ),
        max_num_seqs=config.max_num_seqs,
        max_num_in_flight=config.max_num_in_flight,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the KV cache; see the engine's flags of the same names.

    `kv_watermark`: fraction of the GPU blocks a new request must leave free when admitted, so
    running decodes can grow for a while before anything is preempted.
    `min_swap_tokens`: the preemption rule's threshold (see `choose_preemption_mode`).
    """

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_cache_max_fraction: float = 0.5
    kv_watermark: float = 0.01
    min_swap_tokens: int = 512

    @classmethod
    def from_engine_config(cls, config: EngineConfig, limits: EngineLimits) -> SchedulerConfig:
        return cls(
            block_size=config.block_size,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_num_seqs=limits.max_num_seqs,
            max_model_len=limits.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_cache_max_fraction=config.prefix_cache_max_fraction,
        )


def check_prompt(
    cfg: SchedulerConfig,
    num_prompt_tokens: int,
    max_blocks: int,
    max_num_batched_tokens: int,
) -> None:
    """Raise RequestRejectedError when a prompt of this length can never run: it is empty, it
    leaves no room for a token within `max_model_len`, it needs more than `max_blocks` KV blocks,
    or (without chunked prefill) it exceeds one step's `max_num_batched_tokens`."""
    if num_prompt_tokens == 0:
        raise RequestRejectedError("the prompt is empty")
    if cfg.max_model_len is not None and num_prompt_tokens + 1 > cfg.max_model_len:
        raise RequestRejectedError(
            f"the prompt has {num_prompt_tokens} tokens; with one generated token that "
            f"exceeds the maximum context length of {cfg.max_model_len} tokens"
        )
    num_blocks = num_blocks_for(num_prompt_tokens + 1, cfg.block_size)
    if num_blocks > max_blocks:
        raise RequestRejectedError(
            f"the prompt has {num_prompt_tokens} tokens and needs {num_blocks} KV blocks of "
            f"{cfg.block_size}; the KV cache admits at most {max_blocks} blocks per request"
        )
    if not cfg.enable_chunked_prefill and num_prompt_tokens > max_num_batched_tokens:
        raise RequestRejectedError(
            f"the prompt has {num_prompt_tokens} tokens; without chunked prefill a prompt "
            f"must fit in one step of max_num_batched_tokens={max_num_batched_tokens}"
        )
