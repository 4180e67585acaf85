"""The KV transfer's frames on a byte stream: a fetch request, and the answer (a layout header, then the payload).

    request:  b"PDKV" | u8 version | u32 length | JSON {"transfer_id": ...}
    answer:   b"PDKV" | u8 version | u32 length | JSON header | payload (header["payload_bytes"] bytes)

The header carries everything the receiver checks before a byte of KV is used: the status ("ok" or why
not), the model, the block layout (dtype, one block's shape, tokens per block, block count), the token ids
the blocks hold, and the payload's SHA-256. Pure standard library: the tests build broken frames with it.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from typing import Any

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("!4sBI")  # magic, version, JSON length
MAX_HEADER_BYTES = 64 << 20  # token ids of long prompts; anything larger is not a frame of ours


class WireError(Exception):
    """A frame that is truncated, corrupt, late or not ours: the transfer failed (the caller falls back)."""


def encode_message(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(body)) + body


def checksum(payload: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


class Reader:
    """Exact reads from a socket under one overall deadline (a peer that stalls is as dead as one that closed)."""

    def __init__(self, sock: socket.socket, deadline: float | None) -> None:
        self.sock, self.deadline = sock, deadline

    def exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise WireError(f"timed out with {got} of {n} bytes read")
                self.sock.settimeout(left)
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise WireError(f"timed out with {got} of {n} bytes read") from None
            except OSError as exc:
                raise WireError(f"connection failed with {got} of {n} bytes read: {exc}") from None
            if k == 0:
                raise WireError(f"connection closed with {got} of {n} bytes read")
            got += k
        return buf

    def message(self) -> dict[str, Any]:
        magic, version, length = _PREFIX.unpack(self.exact(_PREFIX.size))
        if magic != MAGIC:
            raise WireError(f"not a KV transfer frame (magic {bytes(magic)!r})")
        if version != VERSION:
            raise WireError(f"frame version {version}, this side speaks {VERSION}")
        if length > MAX_HEADER_BYTES:
            raise WireError(f"header of {length} bytes is over the {MAX_HEADER_BYTES}-byte limit")
        try:
            message = json.loads(self.exact(length))
        except ValueError as exc:
            raise WireError(f"header is not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise WireError("header is not a JSON object")
        return message
