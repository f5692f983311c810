"""Run inside a vLLM environment: decode pagekeeper's KV event payloads with vLLM's own classes
and hash token ids with vLLM's own block hasher.

Reads JSON on stdin: {"payloads": [hex, ...], "chains": [[token ids], ...], "block_size": n,
"seed": the hash seed}. vLLM reads the seed from PYTHONHASHSEED when it sets its root hash; the
interpreter itself accepts only an integer there, so the seed is put in the environment here.
Prints JSON: {"batches": [{"ts", "data_parallel_rank", "events": [...]}], "chains": [[hash,
...], ...]}, each chain the 64-bit hashes vLLM's sha256_cbor gives the full blocks.
"""

import json
import os
import sys

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core import kv_cache_utils

try:
    from vllm.utils.hashing import sha256_cbor
except ImportError:  # vLLM before 0.12
    from vllm.utils import sha256_cbor

request = json.load(sys.stdin)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
batches = []
for payload in request["payloads"]:
    batch = decoder.decode(bytes.fromhex(payload))
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": event.block_hashes,
                    "parent_block_hash": event.parent_block_hash,
                    "token_ids": event.token_ids,
                    "block_size": event.block_size,
                    "lora_id": event.lora_id,
                    "medium": event.medium,
                }
            )
        elif isinstance(event, BlockRemoved):
            events.append(
                {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
            )
        else:
            assert isinstance(event, AllBlocksCleared), event
            events.append({"type": "AllBlocksCleared"})
    batches.append(
        {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}
    )

os.environ["PYTHONHASHSEED"] = request["seed"]
kv_cache_utils.init_none_hash(sha256_cbor)
size = request["block_size"]
chains = []
for token_ids in request["chains"]:
    parent, chain = None, []
    for start in range(0, len(token_ids) - len(token_ids) % size, size):
        parent = kv_cache_utils.hash_block_tokens(
            sha256_cbor, parent, token_ids[start : start + size]
        )
        chain.append(kv_cache_utils.maybe_convert_block_hash(parent))
    chains.append(chain)
print(json.dumps({"batches": batches, "chains": chains}))
