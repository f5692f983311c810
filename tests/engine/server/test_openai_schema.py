"""Every field of OpenAI's request schemas, taken from the installed `openai` package's types,
is honoured or refused with a 400 that names it: none is silently ignored.

A field is honoured when the server answers 200 with its effect (each honoured field's effect
is asserted where `HONOURED` says), refused when the server answers 400 with `param` set to the
field and the value in the message. Every field is declared on the request model, so none can
fall through pydantic's unknown-field drop; a field that a new `openai` release adds fails
`test_the_tables_cover_the_schema` until it is placed in one table or the other.
"""

from __future__ import annotations

from typing import Any

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
import requests
from pydantic import BaseModel

from pagekeeper_engine.frontend.chat_protocol import ChatCompletionRequest
from pagekeeper_engine.frontend.protocol import CompletionRequest
from tests.engine.server.conftest import MODEL_NAME, Server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# field -> (a value other than its default, the test that asserts its effect)
HONOURED: dict[str, dict[str, tuple[Any, str]]] = {
    COMPLETIONS: {
        "model": (MODEL_NAME, "test_bad_requests.test_unknown_model"),
        "prompt": ("hi", "test_openai_client.test_greedy_completion_with_logprobs"),
        "echo": (True, "test_openai_sampling.test_echo_prepends_the_prompt"),
        "frequency_penalty": (0.5, "test_openai_sampling.test_penalties_match_the_reference"),
        "presence_penalty": (0.5, "test_openai_sampling.test_penalties_match_the_reference"),
        "logit_bias": ({"5": 3}, "test_openai_sampling.test_logit_bias_steers_and_names_..."),
        "logprobs": (2, "test_openai_sampling.test_completion_top_logprobs_include_..."),
        "max_tokens": (2, "test_openai_client.test_greedy_completion_with_logprobs"),
        "n": (2, "test_openai_client.test_batched_prompts_with_n"),
        "seed": (7, "test_openai_client.test_seeded_sampling_repeats"),
        "stop": (["x"], "test_openai_client.test_stop_string_cuts_the_text"),
        "stream": (True, "test_openai_client.test_streamed_completion_equals_unstreamed"),
        "stream_options": (
            {"include_usage": True},
            "test_openai_client.test_streamed_completion_equals_unstreamed",
        ),
        "temperature": (0.0, "test_openai_client.test_greedy_completion_with_logprobs"),
        "top_p": (0.5, "tests/engine/cpu/test_sampler.py (the top-p cut)"),
        "user": ("someone", "an identifier: no effect on the answer, as with OpenAI"),
        "best_of": (1, "best_of 1 is the plain completion"),
    },
    CHAT: {
        "model": (MODEL_NAME, "test_bad_requests.test_unknown_model"),
        "messages": ([{"role": "user", "content": "hi"}], "test_openai_client.test_chat_..."),
        "frequency_penalty": (0.5, "test_openai_sampling.test_penalties_match_the_reference"),
        "presence_penalty": (0.5, "test_openai_sampling.test_penalties_match_the_reference"),
        "logit_bias": ({"5": 3}, "test_openai_sampling.test_logit_bias_steers_and_names_..."),
        "logprobs": (True, "test_openai_client.test_chat_completion"),
        "top_logprobs": (2, "test_openai_sampling.test_chat_top_logprobs"),
        "max_completion_tokens": (2, "test_openai_sampling.test_max_completion_tokens_wins_..."),
        "max_tokens": (2, "test_openai_client.test_chat_completion"),
        "n": (2, "test_openai_client.test_batched_prompts_with_n"),
        "seed": (7, "test_openai_client.test_seeded_sampling_repeats"),
        "stop": (["x"], "test_openai_client.test_stop_string_cuts_the_text"),
        "stream": (True, "test_openai_client.test_streamed_chat"),
        "stream_options": ({"include_usage": True}, "test_openai_client.test_streamed_chat"),
        "temperature": (0.0, "test_openai_client.test_chat_completion"),
        "top_p": (0.5, "tests/engine/cpu/test_sampler.py (the top-p cut)"),
        "user": ("someone", "an identifier: no effect on the answer, as with OpenAI"),
        "safety_identifier": ("someone", "an identifier: no effect on the answer"),
        "prompt_cache_key": ("k", "a routing hint: the prefix cache is automatic"),
        "metadata": ({"k": "v"}, "tags for stored completions; none are stored"),
        "parallel_tool_calls": (False, "without tools there is no call to make"),
        "tool_choice": ("none", "without tools, 'none' and 'auto' call nothing"),
        "function_call": ("auto", "without functions, 'none' and 'auto' call nothing"),
        "service_tier": ("default", "the one tier this server has"),
        "store": (False, "nothing is stored"),
        "modalities": (["text"], "text is what the server writes"),
        "prompt_cache_retention": ("in_memory", "the prefix cache lives in memory"),
        # json_object and json_schema need a vocabulary that spells JSON, which this server's
        # has not (it refuses them naming response_format): test_structured_output runs them.
        "response_format": (
            {"type": "text"},
            "test_structured_output.test_every_sampled_reply_matches_its_schema",
        ),
        "tools": ([], "no tools"),
        "functions": ([], "no functions"),
    },
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# field -> values the server cannot honour
REFUSED: dict[str, dict[str, list[Any]]] = {
    COMPLETIONS: {"best_of": [2], "suffix": ["tail"]},
    CHAT: {
        "tools": [[TOOL]],
        "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}],
        "functions": [[{"name": "f", "parameters": {"type": "object"}}]],
        "function_call": [{"name": "f"}],
        "response_format": [{"type": "json_schema"}, {"type": "grammar", "grammar": "root"}],
        "audio": [{"voice": "alloy", "format": "wav"}],
        "modalities": [["text", "audio"]],
        "prediction": [{"type": "content", "content": "guess"}],
        "reasoning_effort": ["low"],
        "verbosity": ["high"],
        "web_search_options": [{}],
        "moderation": [{"model": "omni-moderation-latest"}],
        "store": [True],
        "service_tier": ["priority"],
        "prompt_cache_retention": ["24h"],
        "prompt_cache_options": [{"ttl": "24h"}],
    },
}
SCHEMAS: dict[str, tuple[Any, type[BaseModel]]] = {
    COMPLETIONS: (completion_params, CompletionRequest),
    CHAT: (chat_params, ChatCompletionRequest),
}


def schema_fields(module: Any) -> set[str]:
    """The request's fields as the `openai` package types them (streaming or not)."""
    return set(module.CompletionCreateParamsBase.__annotations__) | set(
        module.CompletionCreateParamsStreaming.__annotations__
    )


def base_body(path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    if path == COMPLETIONS:
        return body | {"prompt": "hi"}
    return body | {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_tables_cover_the_schema(path: str) -> None:
    module, model = SCHEMAS[path]
    fields = schema_fields(module)
    placed = set(HONOURED[path]) | set(REFUSED[path])
    assert fields - placed == set(), "fields in neither table"
    assert placed - fields == set(), "fields the schema does not have"
    assert fields <= set(model.model_fields), "an undeclared field would be dropped unread"


def cases(table: str) -> list[tuple[str, str, Any]]:
    if table == "honoured":
        return [(p, f, v) for p, fields in HONOURED.items() for f, (v, _) in fields.items()]
    return [
        (p, f, v) for p, fields in REFUSED.items() for f, values in fields.items() for v in values
    ]


@pytest.mark.parametrize(("path", "field", "value"), cases("honoured"))
def test_an_honoured_field_is_answered(server: Server, path: str, field: str, value: Any) -> None:
    body = base_body(path) | {field: value}
    if field == "stream_options":
        body["stream"] = True
    if field == "top_logprobs":
        body["logprobs"] = True
    response = requests.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "field", "value"), cases("refused"))
def test_a_refused_field_is_named_with_its_value(
    server: Server, path: str, field: str, value: Any
) -> None:
    response = requests.post(
        f"{server.url}{path}", json=base_body(path) | {field: value}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    assert repr(value) in error["message"], error
