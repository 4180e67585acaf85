"""How a request's KV travels from the prefill engine to the decode engine: the transport interface, and TCP.

The connector needs two things of a transport: the producer publishes a request's KV under a transfer id
(`serve`, with a lookup the transport calls per fetch), the consumer fetches it by id from the producer's
address (`fetch`). TCPTransport does both over one framed connection per fetch (wire.py); the payload is
host memory, so it works between any two machines, CPU or GPU. A CUDA IPC (same host) or NCCL (GPU to GPU)
transport fits the same two calls: it would hand over device memory instead of bytes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.plugins.kv_connectors.pd.wire import Reader, WireError, checksum, encode_message

log = logging.getLogger(__name__)


@dataclass
class HeldKV:
    """One request's prompt KV on the producer, waiting to be fetched."""

    header: dict[str, Any]  # layout, token ids, payload size (wire.py; the sender adds the checksum)
    payload: memoryview  # the blocks' bytes, [num_blocks, *block_shape] in the cache dtype
    expires: float  # time.monotonic() after which it is dropped unfetched


class KVTransport(Protocol):
    def serve(self, take: Callable[[str], HeldKV | None]) -> tuple[str, int]:
        """Start answering fetches; `take(transfer_id)` hands over (and forgets) a held transfer. The address."""
        ...

    def fetch(self, host: str, port: int, transfer_id: str, timeout_s: float) -> tuple[dict[str, Any], bytearray]:
        """The transfer's header and verified payload; WireError when it failed, for whatever reason."""
        ...

    def close(self) -> None: ...


class TCPTransport:
    """One listening socket on the producer (a thread per fetch), one connection per fetch on the consumer."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.bind = (host, port)
        self._listener: socket.socket | None = None

    def serve(self, take: Callable[[str], HeldKV | None]) -> tuple[str, int]:
        listener = socket.create_server(self.bind, reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener, take), name="pd-kv-server", daemon=True).start()
        host, port = listener.getsockname()[:2]
        return host, port

    def _accept(self, listener: socket.socket, take: Callable[[str], HeldKV | None]) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn, take), name="pd-kv-send", daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket, take: Callable[[str], HeldKV | None]) -> None:
        with conn:
            try:
                # A client that connects and says nothing must not hold a thread forever.
                request = Reader(conn, time.monotonic() + 30.0).message()
                held = take(str(request.get("transfer_id")))
                if held is None:
                    conn.sendall(encode_message({"status": "unknown transfer id (never held, expired or taken)"}))
                    return
                # The checksum is computed here, on the sending thread (hashlib releases the GIL), not on the
                # engine's thread that made the copy.
                header = {**held.header, "sha256": checksum(held.payload)}
                conn.settimeout(60.0)
                conn.sendall(encode_message(header))
                conn.sendall(held.payload)
            except (WireError, OSError) as exc:
                log.warning("pd connector: a KV fetch failed on the producer side: %s", exc)

    def fetch(self, host: str, port: int, transfer_id: str, timeout_s: float) -> tuple[dict[str, Any], bytearray]:
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise WireError(f"cannot connect to the prefill engine's KV server {host}:{port}: {exc}") from None
        with sock:
            try:
                sock.sendall(encode_message({"transfer_id": transfer_id}))
            except OSError as exc:
                raise WireError(f"sending the fetch failed: {exc}") from None
            reader = Reader(sock, deadline)
            header = reader.message()
            if header.get("status") != "ok":
                raise WireError(f"the producer has no KV for transfer {transfer_id!r}: {header.get('status')}")
            size = header.get("payload_bytes")
            if not isinstance(size, int) or size < 0:
                raise WireError(f"bad payload_bytes in the header: {size!r}")
            payload = reader.exact(size)
        if checksum(payload) != header.get("sha256"):
            raise WireError("payload checksum mismatch: the KV is corrupt")
        return header, payload

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
