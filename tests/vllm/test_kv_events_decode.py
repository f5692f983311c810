"""The engine's KV event publisher over real ZMQ, its batches decoded with vLLM's own classes
(`vllm.distributed.kv_events`) and its block hashes recomputed with vLLM's own hasher, in each
vLLM environment: vLLM 0.11 reads the array encoding, 0.33 the map encoding."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import zmq

from pagekeeper_engine.core.block_hash import DEFAULT_HASH_SEED, external_block_hash
from pagekeeper_engine.core.kv_events import KVEvent, KVEventLog
from pagekeeper_engine.core.kv_manager import KVCacheManager
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import Sequence
from pagekeeper_engine.kv_events_config import KVEventsConfig
from pagekeeper_engine.kv_events_wire import Encoding
from pagekeeper_engine.kv_publisher import END_OF_REPLAY, ZmqKVEventPublisher
from tests.vllm.conftest import HERE, clean_env, vllm_python

BS = 4
PROMPTS = [list(range(13)), [*range(8), 900, 70000, 5, 6, 7], list(range(300, 320))]
REPLAY_TIMEOUT_MS = 30_000


def workload() -> list[list[KVEvent]]:
    """Three steps' events: two prompts cached, a third that evicts, then a clear."""
    kv = KVCacheManager(
        9, BS, enable_prefix_caching=True, prefix_cache_max_fraction=0.5, num_host_blocks=3
    )
    kv.events = log = KVEventLog(BS)
    steps = []
    for index, prompt in enumerate(PROMPTS):
        seq = Sequence(str(index), prompt, SamplingParams())
        kv.admit(seq, kv.find_cached_prefix(seq))
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_computed_blocks(seq)
        kv.free(seq)
        steps.append(log.take())
    log.close()
    steps.append(log.take())
    return steps


def replay_all(publisher: ZmqKVEventPublisher, num_batches: int) -> list[tuple[bytes, int, bytes]]:
    """Every batch from sequence 0, asked of the replay socket as a late subscriber would (a
    DEALER sending REQ's envelope: an empty frame, then the start sequence)."""
    assert publisher.replay_endpoint is not None
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    frames: list[tuple[bytes, int, bytes]] = []
    try:
        # a batch is buffered once the thread has sent it: ask again until all of them are
        while len(frames) < num_batches:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = []
            while True:
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_OF_REPLAY:
                    break
                frames.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        context.term()
    return frames


@pytest.mark.parametrize(("version", "encoding"), [("0.11.0", "array"), ("0.33.0", "map")])
def test_vllm_decodes_the_published_batches(version: str, encoding: Encoding) -> None:
    python = vllm_python(version)
    steps = workload()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@pod-0@tiny",
    )
    publisher = ZmqKVEventPublisher(config, encoding)
    try:
        for events in steps:
            publisher.publish(events)
        frames = replay_all(publisher, len(steps))
    finally:
        publisher.close()
    assert [(topic, seq) for topic, seq, _ in frames] == [
        (b"kv@pod-0@tiny", seq) for seq in range(len(steps))
    ]
    assert publisher.num_published == sum(len(events) for events in steps)
    assert publisher.num_dropped == 0

    request = {
        "payloads": [p.hex() for _, _, p in frames],
        "chains": PROMPTS,
        "block_size": BS,
        "seed": os.environ.get("PYTHONHASHSEED", DEFAULT_HASH_SEED),  # what the engine used
    }
    env = clean_env()
    env.pop("PYTHONHASHSEED", None)
    done = subprocess.run(
        [str(python), str(HERE / "probe_kv_events.py")],
        input=json.dumps(request),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    expected = [[wire_event(event) for event in events] for events in steps]
    assert [batch["events"] for batch in decoded["batches"]] == expected
    assert {batch["data_parallel_rank"] for batch in decoded["batches"]} == {0}
    # the hashes are the ones vLLM computes from the token ids
    chains = decoded["chains"]
    stored = [e for e in expected[0] if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert stored[0]["block_hashes"] == chains[0]
    assert stored[0]["parent_block_hash"] is None
    second = [e for e in expected[1] if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert (
        second
        == [
            {
                "type": "BlockStored",
                "block_hashes": chains[1][2:],  # its first two blocks were a prefix-cache hit
                "parent_block_hash": chains[1][1],
                "token_ids": PROMPTS[1][8:12],
                "block_size": BS,
                "lora_id": None,
                "medium": "GPU",
            }
        ]
    )
    assert expected[-1] == [{"type": "AllBlocksCleared"}]


def wire_event(event: KVEvent) -> dict[str, object]:
    name = type(event).__name__
    if name == "AllBlocksCleared":
        return {"type": name}
    hashes = [external_block_hash(h) for h in event.block_hashes]  # type: ignore[union-attr]
    if name == "BlockRemoved":
        return {"type": name, "block_hashes": hashes, "medium": event.medium}  # type: ignore[union-attr]
    parent = event.parent_block_hash  # type: ignore[union-attr]
    return {
        "type": name,
        "block_hashes": hashes,
        "parent_block_hash": None if parent is None else external_block_hash(parent),
        "token_ids": event.token_ids,  # type: ignore[union-attr]
        "block_size": BS,
        "lora_id": None,
        "medium": event.medium,  # type: ignore[union-attr]
    }
