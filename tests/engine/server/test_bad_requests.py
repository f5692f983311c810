"""Malformed, impossible and excessive requests get 4xx JSON errors that name the field."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.frontend.app import create_app
from tests.engine.server.checkpoint import VOCAB
from tests.engine.server.conftest import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    Checkpoint,
    Server,
    start_server,
)
from tests.support import step_gate
from tests.support.step_gate import StepGate

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def post(server: Server, path: str, body: Any) -> requests.Response:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    return requests.post(
        f"{server.url}{path}", data=data, timeout=30, headers={"Content-Type": "application/json"}
    )


def assert_error(response: requests.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


def test_bad_json(server: Server) -> None:
    error = assert_error(post(server, COMPLETIONS, b'{"model": "x", "prompt": '), 400, None)
    assert error["code"] == "invalid_json"
    error = assert_error(post(server, CHAT, b"\xff\xfe"), 400, None)
    assert error["code"] == "invalid_json"
    error = assert_error(post(server, COMPLETIONS, "[1, 2]"), 400, None)
    assert error["message"] == "request body must be a JSON object"


@pytest.mark.parametrize(
    ("path", "overrides", "param"),
    [
        (COMPLETIONS, {"max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": "ten"}, "max_tokens"),
        (COMPLETIONS, {"temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt"),
        (COMPLETIONS, {"stream": "yes"}, "stream"),
        (COMPLETIONS, {"n": 10**9}, "n"),
        (COMPLETIONS, {"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        (CHAT, {"top_p": 0}, "top_p"),
        (CHAT, {"n": 17}, "n"),
    ],
)
def test_invalid_fields(server: Server, path: str, overrides: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
    body |= (
        {"prompt": "hi"}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body |= overrides
    error = assert_error(post(server, path, body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_unknown_model(server: Server) -> None:
    response = post(server, COMPLETIONS, {"model": "gpt-9", "prompt": "hi"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found"
    assert MODEL_NAME in error["message"]


def test_prompt_longer_than_the_context(server: Server) -> None:
    long_text = "a" * MAX_MODEL_LEN  # + BOS: one more token than the context
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": long_text}
    error = assert_error(post(server, COMPLETIONS, body), 400, "prompt")
    assert f"{MAX_MODEL_LEN + 1} tokens" in error["message"]
    body = {"model": MODEL_NAME, "prompt": ["ok", long_text]}
    assert_error(post(server, COMPLETIONS, body), 400, "prompt[1]")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}]}
    assert_error(post(server, CHAT, body), 400, "messages")
    # The prompt fits but not with the completion asked for.
    body = {"model": MODEL_NAME, "prompt": "a" * 40, "max_tokens": 30}
    error = assert_error(post(server, COMPLETIONS, body), 400, "max_tokens")
    assert "41 tokens" in error["message"]


def test_token_ids_outside_the_vocabulary(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": [1, len(VOCAB)]}
    error = assert_error(post(server, COMPLETIONS, body), 400, "prompt")
    assert f"token id {len(VOCAB)} is out of range" in error["message"]


def test_too_many_choices_for_the_server(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": ["a"] * 10, "n": 16, "max_tokens": 1}
    error = assert_error(post(server, COMPLETIONS, body), 400, "n")
    assert "160 choices" in error["message"]


def test_oversize_body_and_unknown_routes(server: Server) -> None:
    huge = json.dumps({"model": MODEL_NAME, "prompt": "a" * (17 * 2**20)})
    error = assert_error(post(server, COMPLETIONS, huge), 413, None)
    assert error["code"] == "body_too_large"
    error = assert_error(requests.get(f"{server.url}/v1/nothing", timeout=10), 404, None)
    assert error["type"] == "not_found_error"
    assert_error(requests.get(f"{server.url}{COMPLETIONS}", timeout=10), 405, None)


def scrape(server: Server) -> dict[str, float]:
    """Samples by name and sorted labels, e.g. 'pagekeeper_kv_blocks{state=used}'."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def num_finished(samples: dict[str, float]) -> float:
    return sum(
        samples[f"vllm:request_success_total{{finished_reason={r}}}"]
        for r in ("stop", "length", "abort")
    )


def wait_idle(server: Server, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server)
        idle = (
            samples["vllm:num_requests_running"] == 0
            and samples["vllm:num_requests_waiting"] == 0
            and samples["pagekeeper_kv_blocks{state=used}"] == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


@pytest.fixture
def one_seq_server(checkpoint: Checkpoint, tmp_path: Path, gate: StepGate) -> Iterator[Server]:
    """Runs one sequence at a time, its steps behind `gate`."""
    server = start_server(
        checkpoint.path, tmp_path, "--max-num-seqs", "1", "--num-gpu-blocks-override", "300",
        module=step_gate.MODULE,
    )  # fmt: skip
    yield server
    gate.open()
    assert server.stop() == 0, server.log_tail()


def test_overload_gets_429_and_a_disconnect_frees_its_blocks(
    one_seq_server: Server, gate: StepGate
) -> None:
    """n=9 fills the 1 x 9 slots; a further request is refused with 429 until the client
    disconnects, which aborts its choices in the engine and frees every block."""
    server = one_seq_server
    before = wait_idle(server)
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "ab",
        "n": 9,
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
    }
    # One step, the first choice's first token; then the gate holds all nine in flight.
    gate.allow(1)
    stream = requests.post(f"{server.url}{COMPLETIONS}", json=body, stream=True, timeout=60)
    try:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(lines).startswith(b"data: {")  # in flight now
        refused = post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": "x"})
        error = assert_error(refused, 429, None)
        assert error["code"] == "overloaded"
        assert "at most 9" in error["message"]
        assert refused.headers["Retry-After"] == "1"
    finally:
        stream.close()
    after = wait_idle(server)  # the gate still shut: the core turns, applying the aborts
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["pagekeeper_kv_blocks{state=used}"] == 0
    assert num_finished(after) - num_finished(before) == 9
    aborted = "vllm:request_success_total{finished_reason=abort}"
    assert after[aborted] == before[aborted] + 9
    overloaded = "pagekeeper_requests_rejected_total{reason=overloaded}"
    assert after[overloaded] == before[overloaded] + 1
    # Capacity is back.
    gate.open()
    accepted = post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert accepted.status_code == 200


def test_loading_phase_answers_503() -> None:
    """Before the model is attached: probes and requests say "loading", metrics still scrape."""

    async def run() -> None:
        app = create_app(EngineConfig(model="/m", served_model_name=MODEL_NAME))
        async with TestClient(TestServer(app)) as client:
            health = await client.get("/health")
            assert (health.status, await health.json()) == (503, {"status": "loading"})
            ready = await client.get("/ready")
            assert (ready.status, await ready.json()) == (503, {"status": "loading"})
            refused = await client.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x"})
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "10"
            assert (await refused.json())["error"]["code"] == "loading"
            text = await (await client.get("/metrics")).text()
            names = {f.name for f in text_string_to_metric_families(text)}
            assert "pagekeeper_drain_state" in names
            assert "vllm:num_requests_running" not in names  # no engine to read yet
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL_NAME]

    asyncio.run(run())


def test_the_arrivals_burst_malformed_bodies_are_refused_naming_their_field(server: Server) -> None:
    # benchmarks/arrivals.py counts each of these as "refused" only on this answer; anything
    # else would be counted lost
    from benchmarks.arrivals import MALFORMED, Arrival, outcome  # noqa: PLC0415

    for body, param in MALFORMED:
        response = post(server, COMPLETIONS, body)
        error = response.json()["error"]
        assert outcome(Arrival("malformed", body, param), response.status_code, error, False) == (
            "refused"
        ), (body, response.text)
        if param is not None:
            assert_error(response, 400, param)
