"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Types are strict (a string is not a number, a bool is not an int), unknown fields are ignored as
OpenAI does, and limits that depend on the running engine (`max_model_len`) come in through the
validation context: `Model.model_validate(body, context={"max_model_len": 2048})`.
Fields whose values this engine cannot honour (penalties, `echo`, top-k alternatives) are
accepted only at their neutral value, so a client never gets a silently different answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagekeeper_engine.core.sampling import SamplingParams

MAX_N = 16  # choices per prompt; each one is a running sequence
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_SEED = 2**63 - 1

# A prompt after validation: text, or token ids that are sent to the model as they are.
Prompt = str | list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _max_model_len(info: ValidationInfo) -> int | None:
    context = info.context
    if isinstance(context, dict):
        value = context.get("max_model_len")
        return int(value) if value is not None else None
    return None


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # -1 or 0: no top-k cut (vLLM's convention)
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = None  # a single string is accepted and wrapped
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _within_model_len(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = _max_model_len(info)
        if value is not None and limit is not None and value > limit:
            raise ValueError(f"max_tokens must be at most max_model_len ({limit}), got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: object) -> object:
        if value is None or isinstance(value, str):
            return [value] if isinstance(value, str) and value else None
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} sequences, got {len(value)}")
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported by this engine; send 0 or omit it")
        return value

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingRequest:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, max_tokens: int, *, want_logprobs: bool, index: int
    ) -> SamplingParams:
        """The engine's parameters for choice `index` (n > 1 with a seed gets distinct seeds)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=want_logprobs,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` is text, token ids, or a list of either (a batch)."""

    prompt: list[Prompt]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalise_prompt(cls, value: object) -> list[Prompt]:
        if isinstance(value, str):
            prompts: list[Any] = [value]
        elif _is_token_ids(value) and value:
            prompts = [value]
        elif isinstance(value, list) and value:
            prompts = value
        else:
            raise ValueError(
                "prompt must be a non-empty string, a list of token ids, or a list of those"
            )
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for prompt in prompts:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt must not be empty")
            elif not (_is_token_ids(prompt) and prompt):
                raise ValueError("each prompt must be a non-empty string or list of token ids")
            elif min(prompt) < 0:
                raise ValueError("token ids must be non-negative")
        return prompts

    @field_validator("logprobs")
    @classmethod
    def _sampled_logprob_only(cls, value: int | None) -> int | None:
        if value is not None and value > 0:
            raise ValueError(
                "only the sampled token's logprob is returned; use logprobs=0 (top alternatives "
                "are not supported)"
            )
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
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


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. Without max_tokens a reply may fill the model's context."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_logprob_only(cls, value: int | None) -> int | None:
        if value is not None and value > 0:
            raise ValueError("only the sampled token's logprob is returned; top_logprobs must be 0")
        return value

    def template_messages(self) -> list[dict[str, str]]:
        """Messages in the plain form chat templates expect."""
        return [{"role": m.role, "content": m.text} for m in self.messages]
