"""Structured output through the official `openai` client: every sampled reply to a
`json_schema` request parses and matches its schema, on a random-weight model that would
otherwise write anything; a schema the grammar library rejects, or one the model's vocabulary
cannot begin to spell, is a 400 naming `response_format`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from tests.engine.server.checkpoint import JSON_VOCAB, write_checkpoint
from tests.engine.server.conftest import MODEL_NAME, Server, start_server

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 16  # the samples run 16 at a time
NUM_SAMPLES = 64  # four waves of 16 (the GPU benchmark, structured.py, samples 200)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "tag": {"type": "string", "maxLength": 4},
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["ok", "level", "tag", "items"],
    "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "reply in json"}]


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A model whose vocabulary can spell JSON (braces and quotes), with room for a reply."""
    path: Path = tmp_path_factory.mktemp("json-llama")
    write_checkpoint(path, max_positions=MAX_MODEL_LEN, vocab=JSON_VOCAB)
    server = start_server(
        path,
        tmp_path_factory.mktemp("json-server"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--num-gpu-blocks-override", "256"),
    )
    yield server
    assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def client(json_server: Server) -> OpenAI:
    return OpenAI(base_url=f"{json_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def matches(value: Any) -> bool:
    """`value` matches SCHEMA (checked by hand: the schema is small)."""
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "level", "tag", "items"}
        and isinstance(value["ok"], bool)
        and value["level"] in ("low", "high")
        and isinstance(value["tag"], str)
        and len(value["tag"]) <= 4
        and isinstance(value["items"], list)
        and len(value["items"]) <= 2
        and all(isinstance(item, bool) for item in value["items"])
    )


def test_every_sampled_reply_matches_its_schema(client: OpenAI) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}

    def sample(seed: int) -> tuple[str | None, str]:
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=120,
            response_format=response_format,
        )
        return out.choices[0].message.content, out.choices[0].finish_reason

    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        replies = list(pool.map(sample, range(NUM_SAMPLES)))
    assert [reason for _, reason in replies] == ["stop"] * NUM_SAMPLES
    parsed = [json.loads(text or "") for text, _ in replies]
    assert all(matches(value) for value in parsed), [v for v in parsed if not matches(v)][:3]
    assert len({text for text, _ in replies}) > 1, "the replies are sampled, not fixed"


def test_json_object_replies_open_an_object_and_streaming_agrees(client: OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "max_completion_tokens": 60,
        "response_format": {"type": "json_object"},
    }
    whole = client.chat.completions.create(**args)
    text = whole.choices[0].message.content or ""
    assert text.startswith("{")
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_a_schema_the_library_rejects_is_named(client: OpenAI) -> None:
    for schema in ({"type": 5}, {"$ref": "#/nowhere"}):
        response_format: Any = {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": schema},
        }
        with pytest.raises(BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, response_format=response_format
            )
        assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_completions_honour_response_format_as_vllm_does(client: OpenAI) -> None:
    """Not in OpenAI's completions schema, but vLLM's completions take it: honoured, never
    dropped (a schema reply every time, where the free model would write anything)."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for seed in range(4):
        out = client.completions.create(
            model=MODEL_NAME, prompt="reply in json", max_tokens=120, seed=seed,
            extra_body={"response_format": response_format},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        reply = json.loads(choice.text)
        assert set(reply) == set(SCHEMA["required"]) and reply["level"] in ("low", "high")
    with pytest.raises(BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="x", extra_body={"response_format": {"type": "yaml"}}
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_a_schema_the_vocabulary_cannot_spell_is_refused_before_it_runs(server: Server) -> None:
    """The shared server's vocabulary has neither braces nor quotes: no reply can begin a JSON
    object, so the request is refused (never a 200 with empty content), and the server goes on
    serving."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    formats: list[Any] = [
        {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        {"type": "json_object"},
    ]
    for response_format in formats:
        with pytest.raises(BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, response_format=response_format
            )
        assert info.value.status_code == 400
        body: Any = info.value.body
        assert body["param"] == "response_format", body
        assert body["type"] == "invalid_request_error", body
        assert "vocabulary" in body["message"], body
        with pytest.raises(BadRequestError) as info:
            client.completions.create(
                model=MODEL_NAME, prompt="x", extra_body={"response_format": response_format}
            )
        assert info.value.body["param"] == "response_format"  # type: ignore[index]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_a_reply_the_vocabulary_cannot_finish_says_it_was_cut(client: OpenAI) -> None:
    """The vocabulary can begin the object (`{"`) but has no upper-case letter for its key: the
    reply ends there as "length", neither a complete match nor an empty success."""
    schema = {
        "type": "object",
        "properties": {"Q": {"type": "boolean"}},
        "required": ["Q"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "q", "schema": schema}}
    for stream in (False, True):
        args: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "temperature": 0,
            "max_completion_tokens": 40,
            "response_format": response_format,
        }
        if stream:
            chunks = list(client.chat.completions.create(**args, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
            reason = next(r for r in reasons if r is not None)
        else:
            out = client.chat.completions.create(**args)
            text, reason = out.choices[0].message.content or "", out.choices[0].finish_reason
        assert (text, reason) == ('{"', "length")
