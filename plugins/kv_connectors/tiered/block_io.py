"""Copying whole blocks (every layer's K and V) between the device cache tensors and host tensors.

A block's KV is one host tensor [num cache tensors, *one block's slice of a tensor]: the tensors are the
engine's per-layer caches with duplicates dropped (layers sharing a tensor share its blocks), sliced along
the backend's block axis. On CUDA the copies run on a side stream into pinned memory and the forward's stream
waits for them (`fence`); on the CPU they are plain copies. The same calls serve both.
"""

from __future__ import annotations

import torch


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

    def empty(self) -> torch.Tensor:
        """A host tensor for one block (pinned on CUDA, so copies into it can be asynchronous)."""
        return torch.empty(self.block_shape, dtype=self.dtype, pin_memory=self.pinned)

    def save(self, block_id: int) -> torch.Tensor:
        """The block's KV, copied to a new host tensor (ordered after everything queued on the device so far)."""
        out = self.empty()
        with self._on_side_stream():
            for j, t in enumerate(self.tensors):
                out[j].copy_(t.select(self.axis, block_id), non_blocking=self.pinned)
        return out

    def load(self, block_id: int, data: torch.Tensor) -> None:
        """Write a block's KV (a host tensor from `save` or a file) into device block `block_id`."""
        with self._on_side_stream():
            for j, t in enumerate(self.tensors):
                t.select(self.axis, block_id).copy_(data[j], non_blocking=self.pinned)

    def fence(self) -> None:
        """Make the forward's stream wait for the copies queued so far (nothing to do on the CPU)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def host_ready(self) -> None:
        """Before the host reads a tensor `save` filled: wait for the copies (nothing to do on the CPU)."""
        if self.stream is not None:
            self.stream.synchronize()

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
