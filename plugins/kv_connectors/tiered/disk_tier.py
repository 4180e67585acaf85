"""The local-disk tier: one file per block hash under a directory, with a checksum header; a size cap (LRU).

File layout (little-endian), `<dir>/<layout fingerprint>/<block hash hex>.kvblock`:

    magic  b"PGKVBLK1"      8 bytes
    fingerprint             16 bytes: model, dtype and block shape (a file of another layout never loads)
    block hash              32 bytes: must equal the name's hash
    payload length          8 bytes (u64)
    sha256(payload)         32 bytes
    payload                 the block's KV, raw (BlockIO's layout)

A file that is short, long, of another fingerprint or hash, or whose payload does not match its checksum is a
miss: it is logged, deleted and unindexed, and its tokens are computed instead. Files are written to a
temporary name and renamed, so a crash mid-write leaves no half file under a block's name.

Two sides, two threads: the index (which hashes have a file, LRU order) is the scheduler's, on the engine's
thread; the file operations (`write`, `load`, `delete`) run on the tier's I/O thread (disk_io.py), one at a
time in the order they were queued, and touch nothing but the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger("pagedllm")

_MAGIC = b"PGKVBLK1"
_HEADER = struct.Struct("<8s16s32sQ32s")
_SUFFIX = ".kvblock"


class DiskTier:
    def __init__(self, directory: str, fingerprint: bytes, capacity_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, block_bytes: int) -> None:
        assert len(fingerprint) == 16
        self.fingerprint = fingerprint
        self.dir = Path(directory).expanduser() / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_shape, self.dtype, self.block_bytes = block_shape, dtype, block_bytes
        self.file_bytes = _HEADER.size + block_bytes
        self.capacity_blocks = max(1, capacity_bytes // self.file_bytes)
        # Scheduler side: hashes whose file exists or is queued to be written (the I/O thread runs the queue in
        # order, so a read queued later finds the file), LRU first. Files a previous engine left are indexed
        # oldest first, by modification time.
        self.index: OrderedDict[bytes, None] = OrderedDict()
        files = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                block_hash = bytes.fromhex(path.stem)
            except ValueError:
                continue
            self.index[block_hash] = None

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + _SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    # -- scheduler side --------------------------------------------------------------------------------------

    def add(self, block_hash: bytes, protected: set[bytes]) -> list[bytes]:
        """Index a block about to be written; returns the LRU hashes unindexed to stay under the cap (none of
        `protected`: hits being admitted, connector.py NOTE 3)."""
        self.index[block_hash] = None
        self.index.move_to_end(block_hash)
        dropped = []
        over = len(self.index) - self.capacity_blocks
        if over > 0:
            for old in self.index:
                if old not in protected:
                    dropped.append(old)
                    if len(dropped) == over:
                        break
            for old in dropped:
                del self.index[old]
        return dropped

    def touch(self, block_hash: bytes) -> None:
        self.index.move_to_end(block_hash)

    def unindex(self, block_hash: bytes) -> None:
        """Forget a hash whose file turned out bad or missing (the I/O thread already deleted it)."""
        self.index.pop(block_hash, None)

    # -- I/O thread ----------------------------------------------------------------------------------------------

    def load(self, block_hash: bytes) -> torch.Tensor | str:
        """The block's KV from its file, verified; or why it is a miss (the bad file is deleted)."""
        path = self.path(block_hash)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return "missing (its write was dropped or failed)"
        except OSError as exc:
            why = f"unreadable ({exc})"
        else:
            problem = self._problem(block_hash, raw)
            if problem is None:
                data = torch.frombuffer(bytearray(memoryview(raw)[_HEADER.size:]), dtype=torch.uint8)
                return data.view(self.dtype).reshape(self.block_shape)
            why = problem
        logger.warning("kv disk tier: %s is %s: a miss, its tokens are recomputed", path, why)
        self.delete(block_hash)
        return why

    def _problem(self, block_hash: bytes, raw: bytes) -> str | None:
        if len(raw) != self.file_bytes:
            return f"{len(raw)} bytes, expected {self.file_bytes} (truncated or foreign)"
        magic, fingerprint, stored_hash, length, digest = _HEADER.unpack_from(raw)
        if magic != _MAGIC or fingerprint != self.fingerprint or stored_hash != block_hash:
            return "a file whose header does not match (another layout, block or format)"
        if length != self.block_bytes or hashlib.sha256(memoryview(raw)[_HEADER.size:]).digest() != digest:
            return "a file whose checksum does not match its payload"
        return None

    def write(self, block_hash: bytes, data: torch.Tensor) -> int:
        """Write one block's file (temporary name, then renamed); returns the bytes written."""
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(_MAGIC, self.fingerprint, block_hash, len(payload), hashlib.sha256(payload).digest())
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        return len(header) + len(payload)

    def delete(self, block_hash: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(block_hash).unlink()
