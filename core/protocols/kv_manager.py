"""Single-type KV manager protocol: how one kind of layer (full, sliding window, Mamba) holds its cache.

The coordinator (kv_cache/coordinator.py) owns one manager per KV-cache group; all managers draw blocks from
the one BlockPool. Requests are identified by id; blocks are `KVCacheBlock`s from the pool. Token counts
are absolute (from the start of the request); block hashes are at the manager's own block size. Subclass
`pagedllm.kv_cache.single_type_manager.SingleTypeKVCacheManagerBase` rather than starting from scratch: it
implements everything except `find_longest_cache_hit` and `remove_skipped_blocks`.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.kv_cache.block import KVCacheBlock


class SingleTypeKVCacheManager(Protocol):
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """How many free blocks the pool must give so the request can hold `num_tokens` tokens."""
        ...

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Attach prefix-cache hits (already ref-counted by the caller) to a request that holds no blocks yet."""
        ...

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's block list to cover `num_tokens` tokens; return the new blocks."""
        ...

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Register the hashes of the request's full blocks among its first `num_tokens` tokens.

        `block_hashes` holds one hash per full block at this manager's block size; blocks past its end wait.
        """
        ...

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks this layer type can reuse for the longest prefix of at most `max_length` tokens.

        len(result) * block_size is the hit length; the result may hold the pool's null block where the
        layer type needs no KV. Nothing is ref-counted here.
        """
        ...

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no longer needed (sliding window); full attention keeps everything."""
        ...

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool, its last block first (evicted first)."""
        ...

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block list in block-table order (empty if it holds none); do not modify it."""
        ...
