"""The host-memory tier: block hash -> the block's KV in host memory, least recently used out first.

The index (which hashes the tier holds, in LRU order) is kept by the scheduler side as it plans a step; the
tensors are filled and dropped by the worker side when it runs the plan. Both run in one process, one after
the other, so a plan's operations see the index as the scheduler left it (connector.py NOTE 1).

NOTE 1 (a slab of slots): the blocks live in slots of a few large host allocations (pinned on CUDA), made as
the tier fills, 1 GiB at a time. A pinned allocation per block (cudaHostAlloc: page-locking each time) cost
more than the copies themselves: on the H200, an 8B model's 2 MiB blocks, the host tier was slower than
recomputing the prefixes. A slot is reused once its block leaves the tier; a block being written to disk keeps
its slot until the disk tier's thread has written it (`release`, called from that thread). Past the slots the
tier's capacity needs (the index can run over capacity while hits are protected), a block gets its own
allocation, freed with it.
"""

from __future__ import annotations

import queue
from collections import OrderedDict

import torch

_SLAB_BYTES = 1 << 30


class HostTier:
    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pinned: bool,
                 spare_blocks: int = 0) -> None:
        """:param spare_blocks: slots beyond the capacity: blocks still being written to disk hold theirs."""
        if capacity_blocks < 1:
            raise ValueError(f"plugins.tiered.host_gb holds {capacity_blocks} blocks: raise it to hold one or more")
        self.capacity_blocks = capacity_blocks
        self.index: OrderedDict[bytes, None] = OrderedDict()  # scheduler side, LRU first
        self.store: dict[bytes, torch.Tensor] = {}  # worker side: hash -> its block's tensor (a slot's view)
        self.block_shape, self.dtype, self.pinned = block_shape, dtype, pinned
        self._max_slots = capacity_blocks + spare_blocks
        block_bytes = max(1, torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size())
        self._slab_blocks = max(1, min(self._max_slots, _SLAB_BYTES // block_bytes))
        self._slabs: list[torch.Tensor] = []
        self._free: list[int] = []
        self._slot_of: dict[bytes, int] = {}  # the stored blocks that sit in a slot
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()  # from the disk tier's thread (NOTE 1)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    # -- scheduler side: the index ----------------------------------------------------------------------------

    def add(self, block_hash: bytes) -> None:
        """Index a block (its tensor arrives when the plan runs), as the most recently used."""
        self.index[block_hash] = None

    def touch(self, block_hash: bytes) -> None:
        self.index.move_to_end(block_hash)

    def pop_lru(self, protected: set[bytes]) -> bytes | None:
        """Unindex the least recently used block not in `protected`, while over capacity; None when not over."""
        if len(self.index) <= self.capacity_blocks:
            return None
        for block_hash in self.index:
            if block_hash not in protected:
                del self.index[block_hash]
                return block_hash
        return None  # every entry is a hit being admitted: over capacity until the next eviction

    # -- worker side: the tensors ---------------------------------------------------------------------------

    def new_block(self, block_hash: bytes) -> torch.Tensor:
        """Where the block's KV goes: a free slot, or (past the slots) a tensor of its own (NOTE 1)."""
        slot = self._take_slot()
        if slot is None:
            out = torch.empty(self.block_shape, dtype=self.dtype, pin_memory=self.pinned)
        else:
            out = self._slabs[slot // self._slab_blocks][slot % self._slab_blocks]
            self._slot_of[block_hash] = slot
        self.store[block_hash] = out
        return out

    def drop(self, block_hash: bytes) -> None:
        """The block left the tier: its slot is free for the next block."""
        self.store.pop(block_hash, None)
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def hand_over(self, block_hash: bytes) -> tuple[torch.Tensor, int | None]:
        """Take the block out of the tier keeping its memory: the caller `release`s the slot (if any) when
        done with the tensor (the disk tier's thread, once the file is written)."""
        return self.store.pop(block_hash), self._slot_of.pop(block_hash, None)

    def release(self, slot: int) -> None:
        """A handed-over slot is free again; safe from any thread."""
        self._released.put(slot)

    def _take_slot(self) -> int | None:
        while True:
            try:
                self._free.append(self._released.get_nowait())
            except queue.Empty:
                break
        if self._free:
            return self._free.pop()
        made = len(self._slabs) * self._slab_blocks
        if made >= self._max_slots:
            return None
        blocks = min(self._slab_blocks, self._max_slots - made)
        # (Only the last slab can be short, so slot // slab_blocks still finds every slot's slab.)
        slab = torch.empty((blocks, *self.block_shape), dtype=self.dtype, pin_memory=self.pinned)
        self._slabs.append(slab)
        self._free.extend(range(made + blocks - 1, made, -1))
        return made
