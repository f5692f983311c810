"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Types are strict (a string is not a number, a bool is not an int), fields outside OpenAI's and
vLLM's schemas are ignored as OpenAI does, and limits that depend on the running engine
(`max_model_len`, `vocab_size`) come in through the validation context:
`Model.model_validate(body, context={"max_model_len": 2048, "vocab_size": 32000})`.
Every field of OpenAI's schema is honoured or, where this engine cannot honour the value sent
(`suffix`, `best_of` > 1, tools, structured output), refused with a 400 naming it, so a client
never gets a silently different answer. The chat request is in `chat_protocol`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagekeeper_engine.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 16  # choices per prompt; each one is a running sequence
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias, either way
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound on the biased tokens of one request

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any JSON object
# A prompt after validation: text, or token ids that are sent to the model as they are.
Prompt = str | list[int]


class StrictModel(BaseModel):
    """Strict types; unknown fields dropped."""

    model_config = ConfigDict(strict=True, extra="ignore")


def max_model_len_of(info: ValidationInfo) -> int | None:
    context = info.context
    if isinstance(context, dict):
        value = context.get("max_model_len")
        return int(value) if value is not None else None
    return None


def _vocab_size(info: ValidationInfo) -> int | None:
    context = info.context
    if isinstance(context, dict) and context.get("vocab_size") is not None:
        return int(context["vocab_size"])
    return None


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(StrictModel):
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
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    # token id (a decimal string, as JSON object keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # json_object or json_schema, on either endpoint: OpenAI's chat field, which vLLM's
    # completions take too (checked by `_response_format`, enforced by the sampler)
    response_format: Any = None

    @field_validator("max_tokens")
    @classmethod
    def _within_model_len(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = max_model_len_of(info)
        if value is not None and limit is not None and value > limit:
            raise ValueError(f"max_tokens must be at most max_model_len ({limit}), got {value}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
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

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: object, info: ValidationInfo) -> dict[str, float] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object of token id -> bias")
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}"
            )
        vocab_size = _vocab_size(info)
        checked: dict[str, float] = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if vocab_size is not None and int(key) >= vocab_size:
                raise ValueError(
                    f"logit_bias key {key!r} is outside this model's vocabulary of {vocab_size}"
                )
            is_number = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not is_number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}"
                )
            checked[key] = float(bias)
        return checked

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingRequest:
        limit, name = self.token_limit
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens must not exceed {name}")
        return self

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """The token limit asked for and the field it came from (for errors that name it)."""
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives asked beside each sampled token (the endpoints spell it differently)."""
        return 0

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: object, info: ValidationInfo) -> object:
        if value is None or value == {"type": "text"}:
            return value
        kind = value.get("type") if isinstance(value, dict) else None
        spec = value.get("json_schema") if isinstance(value, dict) else None
        if kind == "json_schema" and not (
            isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and isinstance(spec.get("schema", {}), dict | bool)
        ):
            raise ValueError(
                f"json_schema needs a name and, where given, a schema object; got {value!r}"
            )
        if kind not in ("json_object", "json_schema"):
            raise ValueError(
                f"response_format type must be text, json_object or json_schema; got {value!r}"
            )
        if info.data.get("ignore_eos") or info.data.get("min_tokens"):
            raise ValueError(
                "a structured reply ends where its schema does: ignore_eos and min_tokens "
                f"cannot hold beside it; got {value!r}"
            )
        return value

    @property
    def json_schema(self) -> str | None:
        """The schema every output must match, as JSON text (None: free text)."""
        value = self.response_format
        if not isinstance(value, dict) or value.get("type") == "text":
            return None
        if value["type"] == "json_object":
            return JSON_OBJECT_SCHEMA
        return json.dumps(value["json_schema"].get("schema", {}))

    def sampling_params(
        self, max_tokens: int, *, want_logprobs: bool, index: int
    ) -> SamplingParams:
        """The engine's parameters for choice `index` (n > 1 with a seed gets distinct seeds)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        logit_bias = tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))
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
            logit_bias=logit_bias,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            top_logprobs=self.num_top_logprobs,
            json_schema=self.json_schema,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` is text, token ids, or a list of either (a batch)."""

    prompt: list[Prompt]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
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

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError(
                "echo with logprobs would need the prompt's logprobs, which this engine does "
                "not compute; send echo or logprobs, not both"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError(f"best_of > 1 is not supported; got {value!r}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(f"suffix (insertion) is not supported; got {value!r}")
        return value

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0
