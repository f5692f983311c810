"""Request validation and response shapes, without a server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.frontend import responses as r
from pagekeeper_engine.frontend.chat_protocol import ChatCompletionRequest
from pagekeeper_engine.frontend.errors import APIError, from_validation_error
from pagekeeper_engine.frontend.protocol import MAX_N, CompletionRequest
from pagekeeper_engine.frontend.responses import ChoiceState
from pagekeeper_engine.frontend.serving import check_prompt, resolve_max_tokens

CONTEXT = {"max_model_len": 64, "vocab_size": 500}


def completion(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", **body}, context=CONTEXT)


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **body}, context=CONTEXT)


def error_of(model: type[Any], body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body, context=CONTEXT)
    return from_validation_error(info.value)


def test_completion_defaults_follow_openai() -> None:
    req = completion(prompt="hi")
    assert req.prompt == ["hi"]
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.stream) == (
        16,
        1.0,
        1.0,
        1,
        False,
    )
    assert req.include_usage is False
    assert req.want_logprobs is False


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        ([5, 6, 7], [[5, 6, 7]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [4]], ["a", [4]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize(
    "prompt", ["", [], [[]], [1, "a", 2.5], 5, {"text": "hi"}, [True], [-1, 2], [[1, -3]], None]
)
def test_bad_prompts_name_prompt(prompt: Any) -> None:
    error = error_of(CompletionRequest, {"model": "m", "prompt": prompt})
    assert (error.status, error.param) == (400, "prompt")


def test_too_many_prompts() -> None:
    error = error_of(CompletionRequest, {"model": "m", "prompt": ["a"] * 65})
    assert error.param == "prompt"
    assert "at most 64 prompts" in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 65),  # over max_model_len, from the validation context
        ("max_tokens", "16"),  # strict: a string is not a number
        ("max_tokens", True),  # strict: a bool is not an int
        ("max_tokens", 3.5),
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("n", MAX_N + 1),
        ("n", 10**12),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("stop", 7),
        ("stream", "yes"),
        ("logprobs", 21),
        ("logprobs", -1),
        ("best_of", 2),
        ("suffix", "end"),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"3": 101}),
        ("logit_bias", {"500": 1}),  # outside the vocabulary of the validation context
        ("logit_bias", [1]),
        ("min_tokens", -1),
        ("stop_token_ids", [-4]),
        ("model", ""),
        ("model", 3),
    ],
)
def test_invalid_field_is_named(field: str, value: Any) -> None:
    body = {"model": "m", "prompt": "hi", field: value}
    error = error_of(CompletionRequest, body)
    assert error.status == 400
    assert error.param is not None
    assert error.param.split("[")[0] == field, error.message
    assert error.body()["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": error.param,
        "code": "invalid_value",
    }


def test_missing_required_fields_are_named() -> None:
    assert error_of(CompletionRequest, {"model": "m"}).param == "prompt"
    assert error_of(CompletionRequest, {"prompt": "x"}).param == "model"
    assert error_of(ChatCompletionRequest, {"model": "m"}).param == "messages"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"


def test_nested_chat_errors_name_the_path() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "robot"}]}
    assert error_of(ChatCompletionRequest, body).param == "messages[1].role"
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}
    assert str(error_of(ChatCompletionRequest, body).param).startswith("messages[0].content[0]")
    body = {"model": "m", "messages": [{"role": "user", "content": 5}]}
    assert error_of(ChatCompletionRequest, body).param == "messages[0].content"


def test_min_tokens_above_max_tokens() -> None:
    error = error_of(
        CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 2, "min_tokens": 3}
    )
    assert "min_tokens must not exceed max_tokens" in error.message


def test_unknown_fields_are_ignored() -> None:
    req = completion(prompt="hi", logit_bias=None, some_future_field={"a": 1})
    assert req.prompt == ["hi"]
    assert not hasattr(req, "some_future_field")


def test_sampling_params_mapping() -> None:
    req = completion(
        prompt="hi",
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=7,
        stop="\n",
        stop_token_ids=[9],
        ignore_eos=True,
        min_tokens=2,
        logprobs=0,
    )
    assert req.stop == ["\n"]
    assert req.sampling_params(5, want_logprobs=True, index=2) == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        seed=9,
        stop=("\n",),
        stop_token_ids=(9,),
        ignore_eos=True,
        logprobs=True,
        min_tokens=2,
    )
    assert completion(prompt="x").sampling_params(3, want_logprobs=False, index=4).seed is None


def test_chat_messages_render_as_plain_text() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        logprobs=True,
        top_logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    assert req.max_tokens is None  # chat fills the context unless told
    assert req.include_usage is True
    assert (
        error_of(
            ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}], "top_logprobs": 2}
        ).param
        == "top_logprobs"
    ), "top_logprobs needs logprobs: true"


def test_prompt_and_max_tokens_against_context() -> None:
    check_prompt([1] * 63, 64, 50, "prompt")
    with pytest.raises(APIError) as info:
        check_prompt([1] * 64, 64, 50, "prompt[1]")
    assert (info.value.status, info.value.param) == (400, "prompt[1]")
    assert "64 tokens" in info.value.message
    with pytest.raises(APIError) as info:
        check_prompt([1, 50], 64, 50, "prompt")
    assert "token id 50 is out of range" in info.value.message
    assert resolve_max_tokens(None, 60, 64) == 4
    assert resolve_max_tokens(4, 60, 64) == 4
    with pytest.raises(APIError) as info:
        resolve_max_tokens(5, 60, 64)
    assert info.value.param == "max_tokens"


def test_usage_counts_each_prompt_once() -> None:
    # Two prompts, n=2: prompt tokens count per prompt, completion tokens per choice.
    choices = [
        ChoiceState(0, num_prompt_tokens=5, num_output_tokens=3, num_cached_tokens=0),
        ChoiceState(1, num_prompt_tokens=5, num_output_tokens=4, num_cached_tokens=0),
        ChoiceState(2, num_prompt_tokens=7, num_output_tokens=1, num_cached_tokens=6),
        ChoiceState(3, num_prompt_tokens=7, num_output_tokens=2, num_cached_tokens=6),
    ]
    assert r.usage(choices, num_prompts=2) == {
        "prompt_tokens": 12,
        "completion_tokens": 10,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 6},
    }


def test_logprob_shapes() -> None:
    assert r.completion_logprobs(["ab", "c"], [-0.5, None], text_offset=3) == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-0.5, None],
        "top_logprobs": None,
        "text_offset": [3, 5],
    }
    assert r.chat_logprobs(["é"], [-1.0]) == {
        "content": [{"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": []}]
    }


def test_sse_event_format() -> None:
    assert r.sse_event({"a": [1, 2]}) == b'data: {"a":[1,2]}\n\n'
    assert r.sse_event("[DONE]") == b"data: [DONE]\n\n"
