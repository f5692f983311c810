"""The request body of /v1/chat/completions, over the fields it shares with /v1/completions.

`response_format` json_object and json_schema become the schema the engine's sampler enforces
(`SamplingParams.json_schema`); the engine refuses a schema it cannot enforce. Fields of
OpenAI's chat schema that this engine cannot honour at the value sent (tools, audio,
predicted outputs, ...) are declared here so that a value other
than their neutral one is refused with a 400 naming the field and the value (`REFUSED`); left
undeclared they would be dropped as unknown and the answer would silently differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from pagekeeper_engine.core.sampling_params import MAX_TOP_LOGPROBS
from pagekeeper_engine.frontend.protocol import SamplingRequest, StrictModel, max_model_len_of


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None  # a plain string arrives as one text part
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: object) -> object:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if value is None or isinstance(value, list):
            return value
        raise ValueError("content must be a string or a list of text parts")

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


def _is_none(value: object) -> bool:
    return value is None


def _is_empty(value: object) -> bool:
    return value is None or value == []


def _one_of(*allowed: object) -> Callable[[object], bool]:
    return lambda value: value is None or value in allowed


# field -> (is the value one this engine honours, what it cannot do). Each is refused at any
# other value with a 400 naming the field and the value.
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    "tools": (_is_empty, "tool calling is not supported"),
    "tool_choice": (_one_of("none", "auto"), "without tools, tool_choice is 'none' or 'auto'"),
    "functions": (_is_empty, "function calling is not supported"),
    "function_call": (_one_of("none", "auto"), "function calling is not supported"),
    "audio": (_is_none, "audio output is not supported"),
    "modalities": (_one_of(["text"]), "only text output is supported"),
    "prediction": (_is_none, "predicted outputs are not supported"),
    "reasoning_effort": (_is_none, "this engine does not steer a model's reasoning"),
    "verbosity": (_is_none, "this engine does not steer a reply's verbosity"),
    "web_search_options": (_is_none, "web search is not supported"),
    "moderation": (_is_none, "moderation is not supported"),
    "store": (_one_of(False), "completions are not stored"),
    "service_tier": (_one_of("auto", "default"), "this server has one service tier"),
    "prompt_cache_retention": (
        _one_of("in_memory"),
        "cached prefixes live in memory only, for as long as the KV cache keeps them",
    ),
    "prompt_cache_options": (
        _is_none,
        "the prefix cache is automatic; it takes no breakpoints or lifetimes",
    ),
}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. Without a token limit a reply may fill the model's context.

    `max_completion_tokens` is OpenAI's current name of the limit and `max_tokens` its
    deprecated one: where both are sent, `max_completion_tokens` wins (`token_limit`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # Accepted at any value: identifiers and tags that do not change the reply.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None  # without tools there is nothing to call
    # Refused unless neutral (`REFUSED`).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    @field_validator(*REFUSED)
    @classmethod
    def _refuse_unless_neutral(cls, value: object, info: ValidationInfo) -> object:
        assert info.field_name is not None
        is_neutral, reason = REFUSED[info.field_name]
        if not is_neutral(value):
            raise ValueError(f"{reason}; got {value!r}")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _within_model_len(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = max_model_len_of(info)
        if value is not None and limit is not None and value > limit:
            raise ValueError(
                f"max_completion_tokens must be at most max_model_len ({limit}), got {value}"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """The reply's token limit and the field it came from (for errors that name it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0

    def template_messages(self) -> list[dict[str, str]]:
        """Messages in the plain form chat templates expect."""
        return [{"role": m.role, "content": m.text} for m in self.messages]
