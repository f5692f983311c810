"""A KV-aware router's view of one engine, built from its KV events alone.

Subscribes to the engine's PUB socket, decodes vLLM's array encoding (tagged arrays: what
llm-d's indexer reads) without any of the engine's code, keeps the set of 64-bit block hashes
each medium holds, and fills a gap in the sequence numbers (a late join, a dropped message)
from the replay socket, as a router must.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 100


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class KVRouterView:
    """The blocks one pod holds, per medium, as its events say."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"") -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.RCVTIMEO, 30_000)
        self._replay.connect(replay_endpoint)
        self.blocks: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.next_seq = 0
        self.num_events = 0
        self.num_removed = 0
        self.num_cleared = 0
        self.num_replayed = 0

    def close(self) -> None:
        self._sub.close()
        self._replay.close()
        self._context.term()

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Apply events as they come until `condition` holds."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"never {what}: {self.summary()}"
            self.receive(POLL_MS)

    def summary(self) -> str:
        sizes = {medium: len(hashes) for medium, hashes in self.blocks.items()}
        return (
            f"blocks {sizes}, next seq {self.next_seq}, {self.num_events} events, "
            f"{self.num_cleared} clears, {self.num_replayed} replayed"
        )

    def receive_pending(self) -> None:
        """Apply every message already received, waiting for none."""
        while self._sub.poll(0):
            self.receive(0)

    def receive(self, timeout_ms: int) -> None:
        if not self._sub.poll(timeout_ms):
            return
        _, seq_bytes, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.next_seq:
            self._catch_up()
        if seq == self.next_seq:
            self._apply(seq, payload)

    def _catch_up(self) -> None:
        self._replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            _, _, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_OF_REPLAY:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq == self.next_seq:
                self.num_replayed += 1
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        _ts, events, _rank = msgspec.msgpack.decode(payload)
        for event in events:
            self._apply_event(event)
        self.next_seq = seq + 1

    def _apply_event(self, event: list[Any]) -> None:
        self.num_events += 1
        tag = event[0]
        if tag == "BlockStored":
            _, hashes, _parent, token_ids, block_size, _lora, medium = event
            assert len(token_ids) == block_size * len(hashes), event
            self.blocks[medium].update(hashes)
        elif tag == "BlockRemoved":
            _, hashes, medium = event
            missing = set(hashes) - self.blocks[medium]
            assert not missing, f"removed blocks never stored on {medium}: {missing}"
            self.blocks[medium].difference_update(hashes)
            self.num_removed += len(hashes)
        else:
            assert tag == "AllBlocksCleared", event
            for hashes in self.blocks.values():
                hashes.clear()
            self.num_cleared += 1
