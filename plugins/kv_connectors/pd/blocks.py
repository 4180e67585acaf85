"""Whole blocks (every layer's K and V) gathered from and scattered into the engine's cache tensors.

A batch of blocks is one contiguous host tensor [num_blocks, num cache tensors, *one block's slice]: the
tensors are the per-layer caches with duplicates dropped (layers sharing a tensor share its blocks), sliced
along the backend's block axis. `layout()` names exactly what must match on both engines for the bytes to
mean the same KV.
"""

from __future__ import annotations

import torch


class BlockCopier:
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
        self.axis = block_axis
        self.dtype = first.dtype
        self.block_shape = (len(self.tensors), *first.select(block_axis, 0).shape)
        if any(t.dtype != first.dtype or t.select(block_axis, 0).shape != self.block_shape[1:]
               for t in self.tensors):
            raise ValueError("KV cache tensors of different dtypes or block shapes: one block layout is needed")
        self.block_bytes = first.element_size() * torch.Size(self.block_shape).numel()

    def layout(self) -> dict[str, object]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "block_shape": list(self.block_shape)}

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV in one new contiguous host tensor (a synchronous copy: it reads the finished step)."""
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        for j, t in enumerate(self.tensors):
            out[:, j].copy_(t.index_select(self.axis, index).movedim(self.axis, 0))
        return out

    def scatter(self, data: torch.Tensor, block_ids: list[int]) -> None:
        """Write data[i] (one block's KV, as `gather` laid it out) into device block block_ids[i]."""
        for j, t in enumerate(self.tensors):
            for i, block_id in enumerate(block_ids):
                t.select(self.axis, block_id).copy_(data[i, j], non_blocking=False)

    def from_bytes(self, payload: bytearray, num_blocks: int) -> torch.Tensor:
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(num_blocks, *self.block_shape)
