"""SingleTypeKVCacheManagerBase: the per-request block lists of one KV-cache group, shared by all layer types.

A subclass decides only what differs between layer types: which cached blocks a prefix may reuse
(`find_longest_cache_hit`) and which blocks a request may give back early (`remove_skipped_blocks`).
Growing, caching and freeing the block lists is the same for every type and lives here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool

if TYPE_CHECKING:
    from pagedllm.kv_cache.spec import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens at `b` tokens per block."""
    return -(-a // b)


class SingleTypeKVCacheManagerBase(ABC):
    """Implements `pagedllm.protocols.kv_manager.SingleTypeKVCacheManager` except its two policy methods.

    Block lists are append-only while a request lives (the model runner keeps a copy of each block table);
    a subclass that releases blocks early replaces them with the pool's null block instead of removing them.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache (hits included).
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks the pool must give up so the request holds `num_tokens` tokens.

        Counts the new blocks plus the prefix hits that are free right now (ref_cnt 0): touching them takes
        them out of the free queue, so they cost free capacity just like new blocks do.
        """
        held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_tokens, self.block_size) - held)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Start the request's block list with its prefix hits (already touched by the caller).

        Only a request that holds no blocks yet can have hits: once running, its tokens are computed here.
        """
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            # Hits are registered already; cache_blocks must start after them.
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            assert not new_computed_blocks, f"request {request_id} already holds blocks; it cannot get hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's block list to cover `num_tokens` tokens; return only the blocks added."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens.

        `block_hashes` are this group's hashes (one per `block_size` tokens); blocks without a hash yet are
        left for a later call.
        """
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.group_id
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Give every block of the request back to the pool, tail first (see NOTE 3 in block_pool.py)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block list (the live list: read it, do not change it); empty if it holds none."""
        return self.req_to_blocks.get(request_id, [])

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks that let a request skip its first len(result) * block_size tokens (<= max_length).

        `block_hashes` are the request's hashes at this group's block size. The result may contain the
        null block where a layer type needs no KV (outside a sliding window). Nothing is ref-counted here.
        """

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back blocks the request can no longer read once `num_computed_tokens` are computed."""
