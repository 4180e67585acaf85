"""Single-type KV manager protocol: how one kind of layer (full, sliding window, Mamba) holds its cache.

The coordinator (kv_cache/coordinator.py) owns one manager per KV-cache group; all managers draw blocks from
the one BlockPool. Requests are identified by id; blocks are `KVCacheBlock`s from the pool.
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
        """Attach prefix-cache hits (already ref-counted by the caller) to the request."""
        ...

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's block list to cover `num_tokens` tokens; return the new blocks."""
        ...

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Register the hashes of the request's full blocks among its first `num_tokens` tokens."""
        ...

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Longest run of cached blocks this layer type can reuse for a prefix of at most max_length tokens."""
        ...

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no longer needed (sliding window); full attention keeps everything."""
        ...

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool."""
        ...

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]: ...
