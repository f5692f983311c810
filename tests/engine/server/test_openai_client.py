"""The server driven by the official `openai` client; greedy outputs equal transformers'."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from tests.engine.server.checkpoint import VOCAB, chat_prompt, decode, encode, greedy_reference
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server

NO_EOS: dict[str, Any] = {"ignore_eos": True}  # a random model may say EOS at any point
TOKENS = list(VOCAB)


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completion_with_logprobs(client: OpenAI, checkpoint: Checkpoint) -> None:
    expected_ids, expected_logprobs = greedy_reference(checkpoint.model, encode("hello"), 8)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body=NO_EOS,
    )
    choice = out.choices[0]
    assert choice.text == decode(expected_ids)
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [TOKENS[t] for t in expected_ids]
    assert choice.logprobs.token_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        6,
        8,
        14,
    )
    assert out.model == MODEL_NAME
    assert out.object == "text_completion"


def test_token_id_prompt_equals_text_prompt(client: OpenAI) -> None:
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="the cat", max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    by_ids = client.completions.create(
        model=MODEL_NAME,
        prompt=encode("the cat"),
        max_tokens=5,
        temperature=0,
        extra_body=NO_EOS,
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_batched_prompts_with_n(client: OpenAI, checkpoint: Checkpoint) -> None:
    prompts = ["ab", "hello there"]
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    expected = [decode(greedy_reference(checkpoint.model, encode(p), 4)[0]) for p in prompts]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(encode("ab")) + len(encode("hello there"))
    assert out.usage.completion_tokens == 16


def test_chat_completion(client: OpenAI, checkpoint: Checkpoint) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "hi!"},
    ]
    prompt_ids = chat_prompt(messages)
    expected_ids, expected_logprobs = greedy_reference(checkpoint.model, prompt_ids, 6)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body=NO_EOS,
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == decode(expected_ids)
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == [TOKENS[t] for t in expected_ids]
    got = [t.logprob for t in choice.logprobs.content]
    assert got == pytest.approx(expected_logprobs, abs=1e-4)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 6)


def test_streamed_completion_equals_unstreamed(client: OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "stream me",
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": NO_EOS,
    }
    whole = client.completions.create(**args).choices[0].text
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    # Only the last chunk finishes. (A consumer that falls behind gets the tokens of several
    # steps in one chunk, so on a busy machine the whole completion may be that one chunk.)
    assert all(reason is None for reason in finish[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (10, 10)


def test_streamed_chat(client: OpenAI, checkpoint: Checkpoint) -> None:
    messages: list[Any] = [{"role": "user", "content": "tell me"}]
    expected_ids, _ = greedy_reference(checkpoint.model, chat_prompt(messages), 7)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == decode(expected_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert len({c.id for c in chunks}) == 1


def test_stop_string_cuts_the_text(client: OpenAI, checkpoint: Checkpoint) -> None:
    full = decode(greedy_reference(checkpoint.model, encode("stop"), 12)[0])
    stop = full[4:6]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="stop",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body=NO_EOS,
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client: OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "dice",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": NO_EOS,
    }
    first = client.completions.create(**args).choices[0].text
    second = client.completions.create(**args).choices[0].text
    assert first == second
    assert len(first) > 0
