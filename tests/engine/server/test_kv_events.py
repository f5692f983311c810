"""KV events from the engine's server: a router that sees only the events holds the blocks the
engine says it has cached, after a workload with evictions; a SIGTERM drain clears them at once,
while the requests in flight still run."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_engine.core.block_hash import external_block_hash, hash_block
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server, start_server
from tests.support import step_gate
from tests.support.kv_router import KVRouterView, free_tcp_port
from tests.support.step_gate import StepGate

BLOCK_SIZE = 8  # conftest's --block-size
CONDITION_TIMEOUT_S = 60.0
PROMPT_LEN = 40  # 5 full blocks
NUM_PROMPTS = 16  # about 100 blocks registered against 63 usable: the cache evicts


def sample(server: Server, name: str, **labels: str) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not exported")


def start_with_events(
    checkpoint: Checkpoint, workdir: Path, **kwargs: str
) -> tuple[Server, KVRouterView]:
    port, replay_port = free_tcp_port(), free_tcp_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv@pod-0@tiny-llama",
    }
    server = start_server(
        checkpoint.path, workdir, "--kv-events-config", json.dumps(config), **kwargs
    )
    view = KVRouterView(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", b"kv@")
    return server, view


def complete(server: Server, prompt: list[int], max_tokens: int) -> dict[str, object]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    answer = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    result: dict[str, object] = answer.json()
    return result


def router_hashes(token_ids: list[int]) -> list[int]:
    """What a router computes for a prompt's full blocks (vLLM's sha256_cbor chain)."""
    parent, hashes = b"", []
    for start in range(0, len(token_ids) - len(token_ids) % BLOCK_SIZE, BLOCK_SIZE):
        parent = hash_block(parent, token_ids[start : start + BLOCK_SIZE])
        hashes.append(external_block_hash(parent))
    return hashes


@pytest.fixture
def events_server(checkpoint: Checkpoint, tmp_path: Path) -> Iterator[tuple[Server, KVRouterView]]:
    server, view = start_with_events(checkpoint, tmp_path)
    yield server, view
    view.close()
    server.stop()


def test_a_router_rebuilds_the_cached_blocks_from_the_events(
    events_server: tuple[Server, KVRouterView],
) -> None:
    server, view = events_server
    prompts = [[3 + (p * 7 + i) % 40 for i in range(PROMPT_LEN)] for p in range(NUM_PROMPTS)]
    for prompt in prompts:
        complete(server, prompt, max_tokens=4)
    hit = complete(server, prompts[-1], max_tokens=4)  # a prefix-cache hit stores nothing new
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # type: ignore[index]

    def caught_up() -> bool:
        published = sample(server, "pagekeeper_kv_events_published_total")
        return published > 0 and view.num_events == published

    view.wait_until(caught_up, CONDITION_TIMEOUT_S, "received every published event")
    assert sample(server, "pagekeeper_kv_events_dropped_total") == 0
    assert view.num_removed > 0, "the workload should have evicted blocks"
    cached = sample(server, "pagekeeper_kv_blocks", state="cached")
    assert len(view.blocks["GPU"]) == cached, view.summary()
    assert view.blocks["CPU"] == set()  # no host tier
    # the newest prompt's blocks are where a router computing hashes from tokens looks
    assert set(router_hashes(prompts[-1])) <= view.blocks["GPU"]


@pytest.fixture
def gated_events_server(
    checkpoint: Checkpoint, tmp_path: Path, gate: StepGate
) -> Iterator[tuple[Server, KVRouterView]]:
    server, view = start_with_events(checkpoint, tmp_path, module=step_gate.MODULE)
    yield server, view
    gate.open()
    view.close()
    server.stop()


def test_sigterm_clears_every_block_at_once_and_reports_no_more(
    gated_events_server: tuple[Server, KVRouterView], gate: StepGate
) -> None:
    server, view = gated_events_server
    prompt = list(range(3, 3 + 17))  # 2 full blocks
    gate.allow(1)  # the prefill and its first token, then the request is held
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20, "stream": True}
    stream = requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=120)
    lines = stream.iter_lines()
    assert next(lines).startswith(b"data: {")
    view.wait_until(
        lambda: view.blocks["GPU"] == set(router_hashes(prompt)),
        CONDITION_TIMEOUT_S,
        "saw the prompt's blocks stored",
    )

    server.proc.send_signal(signal.SIGTERM)
    view.wait_until(lambda: view.num_cleared == 1, CONDITION_TIMEOUT_S, "saw AllBlocksCleared")
    assert view.blocks == {"GPU": set(), "CPU": set()}
    assert server.proc.poll() is None  # the request is still held: the drain has not ended

    gate.open()  # the request runs on and fills a third block: nothing more is reported
    assert any(b'"finish_reason":"length"' in line for line in lines if line)
    assert server.proc.wait(timeout=120) == 0
    view.receive_pending()  # the publisher flushed its queue before the process ended
    assert view.num_cleared == 1 and view.blocks == {"GPU": set(), "CPU": set()}, view.summary()
