"""Publishes the engine core's KV cache events over ZMQ, as vLLM's `--kv-events-config` does,
on a thread of its own so that no step waits for the wire.

The step loop calls `publish` with each step's events: it appends to a bounded queue and
returns (when the queue holds `max_queue_size` batches the oldest is dropped and its events
counted in `num_dropped`). The thread encodes each batch (`kv_events_wire`) and sends it on a
PUB socket as three frames, `[topic, sequence, payload]`, the sequence an 8-byte big-endian
count from 0; it keeps the newest `buffer_steps` payloads for the replay socket. A ROUTER on
`replay_endpoint` answers a request whose last frame is an 8-byte big-endian sequence number
with every buffered batch from there, each as `[topic, sequence, payload]`, then an end marker
`["", -1 (8 bytes, signed), ""]`: a subscriber that joined late or missed a sequence number
catches up. The PUB socket drops what a slow subscriber cannot take past `hwm` messages
(ZMQ's behaviour), and such drops are not seen here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from pagekeeper_engine.core.kv_events import KVEvent
from pagekeeper_engine.kv_events_config import KVEventsConfig
from pagekeeper_engine.kv_events_wire import BatchEncoder, Encoding, use_int_block_hashes

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the idle thread waits for a batch before it looks at the replay socket again.
REPLAY_POLL_S = 0.05
CLOSE_TIMEOUT_S = 2.0


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// binds; a named host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """The engine core's `KVEventSink` for `publisher: zmq` (see the module docstring).

    Sockets are made and bound here, so a bad or taken endpoint fails the start-up; after
    that only the thread touches them. `endpoint` and `replay_endpoint` are the addresses
    bound (a port of 0 resolved)."""

    def __init__(self, config: KVEventsConfig, encoding: Encoding = "array") -> None:
        self.num_published = 0  # events sent on the PUB socket (the thread's count)
        self._num_dropped_queued = 0  # events dropped from a full queue (under `_wake`)
        self._num_failed = 0  # events the thread could not send
        self._max_queue_size = config.max_queue_size
        self._topic = config.topic.encode()
        self._encoder = BatchEncoder(encoding, int_hashes=use_int_block_hashes())
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, int(CLOSE_TIMEOUT_S * 1000))
        self.endpoint = self._attach(self._pub, config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            # a whole replay and its end marker fit however slowly the requester reads
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._queue: deque[tuple[float, list[KVEvent]]] = deque()
        self._wake = threading.Condition()
        self._is_closing = False
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def num_dropped(self) -> int:
        """Events that never reached the PUB socket: dropped from a full queue or failed."""
        return self._num_dropped_queued + self._num_failed

    def _attach(self, socket: zmq.Socket[bytes], endpoint: str) -> str:
        if is_bind_endpoint(endpoint):
            socket.bind(endpoint)
            return socket.getsockopt_string(zmq.LAST_ENDPOINT)
        socket.connect(endpoint)
        return endpoint

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events; never waits for the thread or the network."""
        with self._wake:
            if len(self._queue) >= self._max_queue_size:
                _, dropped = self._queue.popleft()
                self._num_dropped_queued += len(dropped)
            self._queue.append((time.time(), events))
            self._wake.notify()

    def close(self) -> None:
        """Send what is queued (within `CLOSE_TIMEOUT_S`), then close the sockets."""
        with self._wake:
            self._is_closing = True
            self._wake.notify()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the KV event publisher did not finish within %.1f s", CLOSE_TIMEOUT_S)
            return  # its sockets stay open; the process is ending
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._is_closing:
                    self._wake.wait(REPLAY_POLL_S)
                batches = list(self._queue)
                self._queue.clear()
                is_closing = self._is_closing
            for ts, events in batches:
                self._send(ts, events)
            self._serve_replays()
            if is_closing:
                return

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        try:
            payload = self._encoder.encode(ts, events)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except (zmq.ZMQError, TypeError, ValueError):
            logger.exception("could not publish KV event batch %d", seq)
            self._num_failed += len(events)
            return
        self._buffer.append((seq, payload))
        self.num_published += len(events)

    def _serve_replays(self) -> None:
        replay = self._replay
        if replay is None:
            return
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("ignoring a replay request of %d frames", len(frames))
                continue
            # [identity, (empty delimiter from a REQ socket,) start sequence]
            route, start = frames[:-1], int.from_bytes(frames[-1], "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart(
                            [*route, self._topic, seq.to_bytes(8, "big"), payload]
                        )
                replay.send_multipart([*route, b"", END_OF_REPLAY, b""])
            except zmq.ZMQError:
                logger.exception("could not answer a replay request")
