"""Block hashes for automatic prefix caching: a chained sha256 over each full block's token ids.

A block's hash covers its own tokens *and*, through the parent hash, every token before it, so equal hashes
mean equal prefixes and one dict look-up per block finds the longest cached prefix. The serialisation is
explicit (tagged, length-prefixed, little-endian) rather than pickle: it must not change between Python
versions or processes, and two different inputs must never serialise to the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol

# Sentinel parent of the first block; any fixed value works as long as no real digest can equal it.
_ROOT = b"pagedllm-kv-root"


class _HashableRequest(Protocol):
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...

    block_hashes: list[bytes]
    cache_salt: str | None


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    """Hash one block: sha256(parent hash, token ids, extra keys); `parent_hash` is None for the first block.

    Extra keys (cache salt, LoRA id, multimodal ids) may be str, bytes, int, bool, None or nested tuples.
    """
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(b"R" + _ROOT)
    else:
        h.update(b"P" + struct.pack("<I", len(parent_hash)) + parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys is not None:
        h.update(b"X")
        _encode(extra_keys, h)
    return h.digest()


def update_block_hashes(request: _HashableRequest, block_size: int) -> None:
    """Append to `request.block_hashes` the hash of every full block of `request.all_token_ids` not yet hashed.

    Call it with the same block_size for the whole life of a request (the KV manager owns that choice). The
    cache salt is mixed into the first block only: chaining carries it into every later hash.
    """
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if num_full <= len(hashes):
        return  # cheap exit for the common decode step, before building all_token_ids
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else None
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)


def _encode(value: Any, h: Any) -> None:
    # Each value gets a one-byte type tag and, where variable-sized, a length: ("ab",) and ("a", "b")
    # must not collide, nor 1 and "1".
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):  # before int: bool is an int subclass
        h.update(b"T" if value else b"F")
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        h.update(b"I" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        h.update(b"S" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, bytes):
        h.update(b"B" + struct.pack("<I", len(value)) + value)
    elif isinstance(value, tuple):
        h.update(b"U" + struct.pack("<I", len(value)))
        for item in value:
            _encode(item, h)
    else:
        raise TypeError(f"cannot hash extra key of type {type(value).__name__}: use str, bytes, int or tuple")
