"""The sampling features, the token limits and the tokenizer's routes through the official
`openai` client (and plain HTTP for the routes it lacks), against the transformers model."""

from __future__ import annotations

from typing import Any

import pytest
import requests
import torch
from openai import BadRequestError, OpenAI
from transformers import PreTrainedModel

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.runner.logits_processing import process_scores_ref
from tests.engine.server.checkpoint import VOCAB, chat_prompt, decode, encode, greedy_reference
from tests.engine.server.conftest import MAX_MODEL_LEN, MODEL_NAME, Checkpoint, Server

NO_EOS: dict[str, Any] = {"ignore_eos": True}
TOKENS = list(VOCAB)
MESSAGES: list[Any] = [{"role": "user", "content": "say it again"}]


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def processed_greedy(
    model: PreTrainedModel, prompt_ids: list[int], num_tokens: int, params: SamplingParams
) -> list[int]:
    """Greedy tokens under the processors (`process_scores_ref`), by full re-forward."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            scores = process_scores_ref(logits, [params], [ids], [len(prompt_ids)])
            ids.append(int(scores.argmax()))
    return ids[len(prompt_ids) :]


def test_max_completion_tokens_wins_over_max_tokens(client: OpenAI) -> None:
    def completion_tokens(**limits: Any) -> int:
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=0, extra_body=NO_EOS, **limits
        )
        assert out.usage is not None and out.choices[0].finish_reason == "length"
        return int(out.usage.completion_tokens)

    assert completion_tokens(max_completion_tokens=3) == 3
    assert completion_tokens(max_tokens=5, max_completion_tokens=2) == 2
    assert completion_tokens(max_tokens=2, max_completion_tokens=5) == 5
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN + 1
        )
    assert info.value.body["param"] == "max_completion_tokens"  # type: ignore[index]
    with pytest.raises(BadRequestError) as info:  # fits max_model_len, not beside the prompt
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN - 2
        )
    assert info.value.body["param"] == "max_completion_tokens"  # type: ignore[index]


def test_logit_bias_steers_and_names_a_key_outside_the_vocabulary(client: OpenAI) -> None:
    target = VOCAB["q"]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=5,
        temperature=0,
        logit_bias={str(target): 100},
        extra_body=NO_EOS,
    )
    assert out.choices[0].text == "qqqqq"
    with pytest.raises(BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="hello", max_tokens=2, logit_bias={str(len(VOCAB)): 5}
        )
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]
    assert f"'{len(VOCAB)}'" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.9},
        {"repetition_penalty": 0.7, "presence_penalty": -0.4, "frequency_penalty": 0.6},
    ],
)
def test_penalties_match_the_reference(
    client: OpenAI, checkpoint: Checkpoint, penalties: dict[str, float]
) -> None:
    prompt_ids = encode("abab cdcd")
    expected = processed_greedy(checkpoint.model, prompt_ids, 10, SamplingParams(**penalties))  # type: ignore[arg-type]
    plain, _ = greedy_reference(checkpoint.model, prompt_ids, 10)
    assert expected != plain, "the penalties change this greedy continuation"
    extra: dict[str, Any] = dict(NO_EOS)
    if "repetition_penalty" in penalties:
        extra["repetition_penalty"] = penalties["repetition_penalty"]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="abab cdcd",
        max_tokens=10,
        temperature=0,
        presence_penalty=penalties.get("presence_penalty", 0.0),
        frequency_penalty=penalties.get("frequency_penalty", 0.0),
        extra_body=extra,
    )
    assert out.choices[0].text == decode(expected)


def test_min_p_of_one_keeps_only_the_likeliest(client: OpenAI, checkpoint: Checkpoint) -> None:
    expected, _ = greedy_reference(checkpoint.model, encode("min p"), 8)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="min p",
        max_tokens=8,
        temperature=1.5,
        extra_body={**NO_EOS, "min_p": 1.0},
    )
    assert out.choices[0].text == decode(expected)


def test_chat_top_logprobs(client: OpenAI, checkpoint: Checkpoint) -> None:
    prompt_ids = chat_prompt(MESSAGES)
    expected_ids, _ = greedy_reference(checkpoint.model, prompt_ids, 3)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body=NO_EOS,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    ids = list(prompt_ids)
    with torch.no_grad():
        for entry, token_id in zip(content, expected_ids, strict=True):
            log_probs = checkpoint.model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            values, top_ids = log_probs.topk(4)
            assert [t.token for t in entry.top_logprobs] == [TOKENS[t] for t in top_ids]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                values.tolist(), abs=1e-4
            )
            assert entry.top_logprobs[0].token == entry.token == TOKENS[token_id]
            ids.append(token_id)


def test_completion_top_logprobs_include_the_sampled_token(client: OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=1.0, seed=3, logprobs=2
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 2 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob)


def test_echo_prepends_the_prompt(client: OpenAI) -> None:
    plain = client.completions.create(
        model=MODEL_NAME, prompt="echo", max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    echoed = client.completions.create(
        model=MODEL_NAME, prompt="echo", max_tokens=4, temperature=0, echo=True, extra_body=NO_EOS
    )
    assert echoed.choices[0].text == "echo" + plain.choices[0].text
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=encode("echo"),
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
        extra_body=NO_EOS,
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == (
        "echo" + plain.choices[0].text
    )
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="echo", echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"  # type: ignore[index]


def test_tokenize_detokenize_version(server: Server) -> None:
    def post(path: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(f"{server.url}{path}", json=body, timeout=30)

    answer = post("/tokenize", {"model": MODEL_NAME, "prompt": "hello"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "count": 6,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": encode("hello"),
    }
    answer = post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True})
    assert answer.json()["tokens"] == chat_prompt(MESSAGES)
    answer = post(
        "/tokenize", {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True}
    )
    assert answer.json()["token_strs"] == ["a", "b"]
    answer = post("/detokenize", {"model": MODEL_NAME, "tokens": encode("hi there")})
    assert answer.json() == {"prompt": "<s>hi there"}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/detokenize", {"tokens": [5, len(VOCAB)]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ]
    for path, body, param in cases:
        answer = post(path, body)
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["param"] == param, (path, body, answer.text)
    version = requests.get(f"{server.url}/version", timeout=30)
    assert version.status_code == 200
    assert set(version.json()) == {"version"} and version.json()["version"]
