"""KV cache events in vLLM's wire format: one MessagePack payload per batch.

A batch is the array `[ts, [event, ...], data_parallel_rank]` (vLLM's `KVEventBatch`; this
engine is data-parallel rank 0). vLLM has encoded events in two ways, chosen here by
`--kv-events-encoding`:

- `array` (vLLM 0.11, and the routers written against it, llm-d's KV-cache indexer among them):
  each event a tagged array, `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`;
- `map` (vLLM 0.33): each event a map with its tag under `"type"` and vLLM's field names
  (`BlockStored` adds `lora_name`; fields at their defaults are left out, as vLLM does).

Block hashes go out as their low 64 bits, an unsigned integer (vLLM's default); with vLLM's
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` as the 32-byte digests. See `core.block_hash`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from pagekeeper_engine.core.block_hash import external_block_hash
from pagekeeper_engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekeeper_engine.kv_events_config import KV_EVENTS_ENCODINGS

Encoding = Literal["array", "map"]
DATA_PARALLEL_RANK = 0


def use_int_block_hashes() -> bool:
    """vLLM's switch, read the way vLLM reads it (default on)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


class BatchEncoder:
    """Encodes batches of `core.kv_events` events; one per thread (msgspec's encoder buffer)."""

    def __init__(self, encoding: Encoding, *, int_hashes: bool = True) -> None:
        assert encoding in KV_EVENTS_ENCODINGS, f"unknown encoding {encoding!r}"
        self.encoding = encoding
        self._hash: Any = external_block_hash if int_hashes else bytes
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[KVEvent]) -> bytes:
        body = [self._event(event) for event in events]
        return self._encoder.encode([ts, body, DATA_PARALLEL_RANK])

    def _event(self, event: KVEvent) -> list[Any] | dict[str, Any]:
        to_wire = self._hash
        if isinstance(event, BlockStored):
            hashes = [to_wire(h) for h in event.block_hashes]
            parent = None if event.parent_block_hash is None else to_wire(event.parent_block_hash)
            if self.encoding == "array":
                return [
                    "BlockStored",
                    hashes,
                    parent,
                    event.token_ids,
                    event.block_size,
                    None,
                    event.medium,
                ]
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": None,
                "medium": event.medium,
                "lora_name": None,
            }
        if isinstance(event, BlockRemoved):
            hashes = [to_wire(h) for h in event.block_hashes]
            if self.encoding == "array":
                return ["BlockRemoved", hashes, event.medium]
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": event.medium}
        assert isinstance(event, AllBlocksCleared), f"not a KV event: {event!r}"
        return ["AllBlocksCleared"] if self.encoding == "array" else {"type": "AllBlocksCleared"}
