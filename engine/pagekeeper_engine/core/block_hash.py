"""Chained block hashes, computed the way vLLM's `--prefix-caching-hash-algo sha256_cbor` does,
so a KV-aware router that recomputes vLLM's hashes from token ids finds this engine's blocks.

A full block's hash is SHA-256 over the canonical CBOR encoding of the array
`[parent_hash, [token ids...], null]` (null: no extra keys: no LoRA, multimodal input or cache
salt); the first block's parent is `ROOT_HASH` = SHA-256 of the CBOR text string of the seed:
`PYTHONHASHSEED` when set, else vLLM's fixed default `"vllm-none-hash"`. Published events carry
the low 64 bits of each hash (`external_block_hash`), as vLLM does by default.

Pure Python; never imports torch. The CBOR encoder covers only the shapes above (byte string,
array of unsigned integers, text string, null) and emits each item in its shortest form, which
is what canonical CBOR asks of them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

DEFAULT_HASH_SEED = "vllm-none-hash"
_UINT64_MASK = (1 << 64) - 1
_MAJOR_UINT, _MAJOR_BYTES, _MAJOR_TEXT, _MAJOR_ARRAY = 0x00, 0x40, 0x60, 0x80
_ARRAY_OF_3 = bytes((_MAJOR_ARRAY | 3,))
_NULL = b"\xf6"


def _head(major: int, value: int) -> bytes:
    """A CBOR item's head: its major type and a length or value, in the shortest form."""
    if value < 24:
        return bytes((major | value,))
    if value < 1 << 8:
        return bytes((major | 24, value))
    if value < 1 << 16:
        return bytes((major | 25,)) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes((major | 26,)) + value.to_bytes(4, "big")
    return bytes((major | 27,)) + value.to_bytes(8, "big")


class _TokenCodes(dict[int, bytes]):
    """Each token id's CBOR encoding, made once: a block of 16 ids then costs one join."""

    def __missing__(self, token_id: int) -> bytes:
        assert token_id >= 0, f"token id {token_id} is negative"
        code = self[token_id] = _head(_MAJOR_UINT, token_id)
        return code


_TOKEN_CODES = _TokenCodes()


def root_hash(seed: str) -> bytes:
    """The parent hash of every sequence's first block for this seed."""
    data = seed.encode()
    return hashlib.sha256(_head(_MAJOR_TEXT, len(data)) + data).digest()


ROOT_HASH = root_hash(os.environ.get("PYTHONHASHSEED", DEFAULT_HASH_SEED))


def hash_block(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full block: it names the block's tokens and everything before them.
    `parent_hash` b"": the first block (its parent is `ROOT_HASH`).

    SHA-256 rather than Python's `hash`: a collision would silently serve another prompt's keys
    and values."""
    parent = parent_hash or ROOT_HASH
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    codes = b"".join(map(_TOKEN_CODES.__getitem__, ids))
    payload = b"".join(
        (_ARRAY_OF_3, _head(_MAJOR_BYTES, len(parent)), parent, _head(_MAJOR_ARRAY, len(ids)))
    )
    return hashlib.sha256(payload + codes + _NULL).digest()


def external_block_hash(block_hash: bytes) -> int:
    """The hash as KV events carry it: its low 64 bits (its last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash, "big") & _UINT64_MASK
