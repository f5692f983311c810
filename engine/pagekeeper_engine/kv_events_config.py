"""`--kv-events-config`: where the engine publishes its KV cache events, as vLLM spells it.

The flag takes one JSON object whose field names, defaults and meanings are vLLM's
`KVEventsConfig`, so one rendered argument drives either runtime. Pure: the operator's contract
test and the engine's parser both read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Literal

PUBLISHERS = ("null", "zmq")
# How events are encoded on the wire (`kv_events_wire`); not part of vLLM's JSON, whose parser
# refuses fields it does not know, so a flag of its own.
KV_EVENTS_ENCODINGS = ("array", "map")
# ZMQ transports a publisher can bind or connect; anything else is a typo that would only
# surface when the core process starts.
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how KV cache events are published (vLLM's `KVEventsConfig`)."""

    # Record BlockStored / BlockRemoved / AllBlocksCleared at all.
    enable_kv_cache_events: bool = False
    # "zmq": a PUB socket; "null": recorded and dropped. Unset: "zmq" when events are enabled.
    publisher: Literal["null", "zmq"] = "null"
    # The PUB socket: a wildcard host ("tcp://*:5557"), ipc:// or inproc:// binds; a named host
    # connects (to a proxy that binds).
    endpoint: str = "tcp://*:5557"
    # A ROUTER socket (always bound) that resends buffered batches from a sequence number.
    replay_endpoint: str | None = None
    # Batches (one per engine step that had events) kept for replay.
    buffer_steps: int = 10_000
    # The PUB socket's send high-water mark in messages; 0: unbounded (ZMQ's meaning).
    hwm: int = 100_000
    # Batches waiting for the publisher thread; past it the oldest is dropped and counted.
    max_queue_size: int = 100_000
    # The first frame of every message; subscribers filter on its prefix.
    topic: str = ""

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _is_endpoint(text: str) -> bool:
    return text.startswith(ENDPOINT_SCHEMES) and len(text) > text.index("//") + 2


def _is_bind_endpoint(text: str) -> bool:
    return "*" in text or "::" in text or text.startswith(("ipc://", "inproc://"))


def _check_int(name: str, value: object, lo: int) -> int:
    # bool is an int in Python; `true` for a count is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {json.dumps(value)}")
    if value < lo:
        raise ValueError(f"{name}: {value} is below {lo}")
    return value


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse and validate the flag's JSON; a ValueError names the bad field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at position {exc.pos})") from exc
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object of vLLM's KVEventsConfig fields")
    known = [f.name for f in fields(KVEventsConfig)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; the fields are {', '.join(known)}")

    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(
            f"enable_kv_cache_events: expected true or false, got {json.dumps(enable)}"
        )
    given = raw.get("publisher")
    publisher: Literal["null", "zmq"]
    if given is None:
        publisher = "zmq" if enable else "null"
    elif given == "zmq" or given == "null":  # noqa: PLR1714 (narrows the Literal for mypy)
        publisher = given
    else:
        raise ValueError(f"publisher: {json.dumps(given)} is not one of {', '.join(PUBLISHERS)}")

    endpoint = raw.get("endpoint", KVEventsConfig.endpoint)
    if not isinstance(endpoint, str) or not _is_endpoint(endpoint):
        raise ValueError(
            f"endpoint: {json.dumps(endpoint)} is not a ZMQ endpoint "
            f"({', '.join(s + '...' for s in ENDPOINT_SCHEMES)}, e.g. tcp://*:5557)"
        )
    replay = raw.get("replay_endpoint")
    if replay is not None:
        if not isinstance(replay, str) or not _is_endpoint(replay):
            raise ValueError(
                f"replay_endpoint: {json.dumps(replay)} is not a ZMQ endpoint (e.g. tcp://*:5558)"
            )
        if not _is_bind_endpoint(replay):
            raise ValueError(
                f"replay_endpoint: {replay!r} names a host; the replay socket is always bound, "
                "so give a wildcard host (tcp://*:5558), ipc:// or inproc://"
            )
        if replay == endpoint:
            raise ValueError("replay_endpoint: the same as endpoint; the two sockets need two")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise ValueError(f"topic: expected a string, got {json.dumps(topic)}")
    return KVEventsConfig(
        enable_kv_cache_events=enable,
        publisher=publisher,
        endpoint=endpoint,
        replay_endpoint=replay,
        buffer_steps=_check_int("buffer_steps", raw.get("buffer_steps", 10_000), 1),
        hwm=_check_int("hwm", raw.get("hwm", 100_000), 0),
        max_queue_size=_check_int("max_queue_size", raw.get("max_queue_size", 100_000), 1),
        topic=topic,
    )
