"""`--api-key`: the OpenAI endpoints want the bearer token, the probes and Prometheus do not;
driven by the official `openai` client and plain HTTP for the headers a client would not send."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests
from openai import OpenAI

from pagekeeper_engine.config import parse_args
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server, start_server

KEY = "sk-pagekeeper-test-4f1c"


@pytest.fixture(scope="module")
def locked(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(checkpoint.path, tmp_path_factory.mktemp("locked"), "--api-key", KEY)
    yield server
    assert server.stop() == 0, server.log_tail()


def client(server: Server, key: str) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_right_key_is_served(locked: Server) -> None:
    out = client(locked, KEY).completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert [m.id for m in client(locked, KEY).models.list().data] == [MODEL_NAME]


def test_a_wrong_key_is_401_naming_the_header(locked: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(locked, "sk-wrong").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["param"] == "Authorization"
    assert caught.value.response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "missing API key"),
        ({"Authorization": KEY}, "malformed Authorization header"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "malformed Authorization header"),
        ({"Authorization": "Bearer "}, "malformed Authorization header"),
    ],
)
def test_no_key_or_a_malformed_header_is_401_json(
    locked: Server, headers: dict[str, str], message: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    answer = requests.post(f"{locked.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 401
    assert answer.json()["error"]["message"].startswith(message)


def test_probes_and_metrics_need_no_key(locked: Server) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert requests.get(f"{locked.url}{path}", timeout=30).status_code == 200, path


@pytest.mark.parametrize("bad", ["", "sk-abc\n", " sk-abc"], ids=["empty", "newline", "space"])
def test_a_key_no_request_could_carry_is_refused_at_start(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Empty would leave /v1/* open; surrounding whitespace can never arrive in a header.
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["/m", f"--api-key={bad}"])
    assert exit_info.value.code == 2
    assert "argument --api-key: the key is empty or begins or ends with whitespace" in (
        capsys.readouterr().err
    )
    assert parse_args(["/m", "--api-key=-dash-first"]).api_key == "-dash-first"
