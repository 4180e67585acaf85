"""The host-memory tier: block hash -> one host tensor of the block's KV, least recently used out first.

The index (which hashes the tier holds, in LRU order) is kept by the scheduler side as it plans a step; the
tensors are filled and dropped by the worker side when it runs the plan. Both run in one process, one after
the other, so a plan's operations see the index as the scheduler left it (connector.py NOTE 1).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"plugins.tiered.host_gb holds {capacity_blocks} blocks: raise it to hold one or more")
        self.capacity_blocks = capacity_blocks
        self.index: OrderedDict[bytes, None] = OrderedDict()  # scheduler side, LRU first
        self.store: dict[bytes, torch.Tensor] = {}  # worker side

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

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
