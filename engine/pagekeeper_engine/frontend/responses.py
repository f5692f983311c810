"""Response bodies of the OpenAI-compatible API, built from plain values (no I/O).

Shapes follow OpenAI's: `text_completion` objects for /v1/completions, `chat.completion` and
`chat.completion.chunk` for chat, `usage` with `prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

Json = dict[str, object]


@dataclass
class ChoiceState:
    """What one choice has produced so far; accumulated from the engine's outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


def usage(choices: list[ChoiceState], num_prompts: int) -> Json:
    """Prompt tokens count once per prompt (n choices share one prompt), as OpenAI counts them."""
    per_prompt = len(choices) // max(num_prompts, 1)
    prompt_choices = choices[::per_prompt] if per_prompt else []
    num_prompt = sum(c.num_prompt_tokens for c in prompt_choices)
    num_cached = sum(c.num_cached_tokens for c in prompt_choices)
    num_completion = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


# One token's alternatives as (token text, log-probability), likeliest first.
TopAlternatives = list[tuple[str, float]]


def completion_logprobs(
    tokens: list[str],
    logprobs: list[float | None],
    text_offset: int,
    top: list[TopAlternatives] | None = None,
) -> Json:
    """The legacy completions logprobs object. `top_logprobs` (None unless asked) maps each
    alternative's text to its logprob, with the sampled token's always among them, as
    OpenAI's (so up to logprobs + 1 entries)."""
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_json: list[dict[str, float | None]] | None = None
    if top is not None:
        top_json = []
        for token, logprob, alternatives in zip(tokens, logprobs, top, strict=True):
            entry: dict[str, float | None] = dict(alternatives)
            entry.setdefault(token, logprob)
            top_json.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_json,
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float | None) -> Json:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    tokens: list[str], logprobs: list[float | None], top: list[TopAlternatives] | None = None
) -> Json:
    tops = top if top is not None else [[] for _ in tokens]
    content = [
        _chat_token(token, logprob)
        | {"top_logprobs": [_chat_token(text, value) for text, value in alternatives]}
        for token, logprob, alternatives in zip(tokens, logprobs, tops, strict=True)
    ]
    return {"content": content}


def completion_response(
    request_id: str, created: int, model: str, choices: list[Json], usage_body: Json
) -> Json:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: Json | None
) -> Json:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(
    request_id: str, created: int, model: str, choices: list[Json], usage_body: Json
) -> Json:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: Json | None) -> Json:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[Json],
    usage_body: Json | None = None,
) -> Json:
    chunk: Json = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_body is not None:
        chunk["usage"] = usage_body
    return chunk


def chat_delta(
    index: int, delta: Json, finish_reason: str | None, logprobs: Json | None = None
) -> Json:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[Json],
    usage_body: Json | None = None,
) -> Json:
    chunk = completion_response(request_id, created, model, choices, usage_body or {})
    if usage_body is None:
        del chunk["usage"]
    return chunk


def sse_event(payload: Json | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def model_list(model_name: str, created: int, max_model_len: int | None) -> Json:
    return {
        "object": "list",
        "data": [
            {
                "id": model_name,
                "object": "model",
                "created": created,
                "owned_by": "pagekeeper",
                "max_model_len": max_model_len,
            }
        ],
    }
