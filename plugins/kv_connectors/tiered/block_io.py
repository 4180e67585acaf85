"""Copying whole blocks (every layer's K and V) between the device cache tensors and host tensors.

A block's KV is one host tensor [num cache tensors, *one block's slice of a tensor]: the tensors are the
engine's per-layer caches with duplicates dropped (layers sharing a tensor share its blocks), sliced along
the backend's block axis. On CUDA the copies run on a side stream into pinned memory and the forward's stream
waits for them (`fence`); on the CPU they are plain copies. The same calls serve both.

The forward waits for every copy of its step's plan, and only those: a load fills a block it reads, a save
reads a block it is about to overwrite (the evicted block's new owner). Disk files are written and read on
the disk tier's own thread (disk_io.py), never in front of a forward.
"""

from __future__ import annotations

import torch

# Blocks per batched gather / scatter: bounds the device staging buffer (64 blocks of an 8B model's KV at
# 16 tokens a block are 128 MiB).
_CHUNK = 64


class BlockIO:
    """Gather / scatter of blocks across the cache tensors of one engine."""

    def __init__(self, kv_caches: list[torch.Tensor], block_axis: int) -> None:
        seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        for t in kv_caches:
            if t.data_ptr() not in seen:  # layers sharing a slot list one tensor several times
                seen.add(t.data_ptr())
                self.tensors.append(t)
        if not self.tensors:
            raise ValueError("no KV cache tensors to connect")
        first = self.tensors[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in self.tensors):
            raise ValueError("KV cache tensors of different dtypes or devices: one block layout is needed")
        self.axis = block_axis
        self.dtype = first.dtype
        self.device = first.device
        self.block_shape = (len(self.tensors), *first.select(block_axis, 0).shape)
        if any(t.select(block_axis, 0).shape != self.block_shape[1:] for t in self.tensors):
            raise ValueError("KV cache tensors of different block shapes: one block layout is needed")
        self.block_bytes = first.element_size() * torch.Size(self.block_shape).numel()
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None

    def save(self, block_ids: list[int], outs: list[torch.Tensor]) -> None:
        """Copy the blocks' KV into host tensors `outs` (ordered after everything queued on the device so far).
        Batched: per chunk of blocks one gather per cache tensor into a device staging buffer, then one
        contiguous copy per block -- a copy per (block, layer) was ~30 Python-level copies a block."""
        with self._on_side_stream():
            for start in range(0, len(block_ids), _CHUNK):
                ids = block_ids[start:start + _CHUNK]
                staging = self._staging(len(ids))
                index = torch.tensor(ids, device=self.device)
                for j, t in enumerate(self.tensors):
                    staging[:, j] = t.index_select(self.axis, index).movedim(self.axis, 0)
                for i, out in enumerate(outs[start:start + _CHUNK]):
                    out.copy_(staging[i], non_blocking=self.pinned)

    def load(self, block_ids: list[int], datas: list[torch.Tensor]) -> None:
        """Write blocks' KV (host tensors from `save` or files) into device blocks `block_ids`, batched as
        `save` is (the targets are distinct blocks: one plan never loads two hits into one block)."""
        with self._on_side_stream():
            for start in range(0, len(block_ids), _CHUNK):
                ids = block_ids[start:start + _CHUNK]
                staging = self._staging(len(ids))
                for i, data in enumerate(datas[start:start + _CHUNK]):
                    staging[i].copy_(data, non_blocking=self.pinned)
                index = torch.tensor(ids, device=self.device)
                for j, t in enumerate(self.tensors):
                    t.index_copy_(self.axis, index, staging[:, j].movedim(0, self.axis))

    def _staging(self, n: int) -> torch.Tensor:
        # Allocated on the side stream (inside _on_side_stream), so the caching allocator reuses it only
        # after the copies queued there.
        return torch.empty((n, *self.block_shape), dtype=self.dtype, device=self.device)

    def fence(self) -> None:
        """Make the forward's stream wait for the copies queued so far (nothing to do on the CPU)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def copies_done_event(self) -> torch.cuda.Event | None:
        """An event the copies queued so far record (None on the CPU, where they are done already): the disk
        tier's I/O thread waits for it before writing a saved tensor, so the step does not."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _on_side_stream(self) -> torch.cuda.StreamContext | _NoStream:
        if self.stream is None:
            return _NoStream()
        # The side stream starts after the work already queued on the forward's stream (the step before's
        # forward wrote the blocks being saved).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
