"""FullAttentionManager: every token attends to every earlier one, so any cached prefix block is reusable."""

from __future__ import annotations

from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase


class FullAttentionManager(SingleTypeKVCacheManagerBase):
    """KV manager for causal full attention: the cache grows one slot per token; nothing is released early."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The leading run of `block_hashes` found in the pool, at most `max_length // block_size` blocks.

        The run stops at the first miss: a block's KV is only usable together with every block before it
        (it was computed attending to them), so a hit must be a leading run.
        """
        hits: list[KVCacheBlock] = []
        get_cached_block = self.block_pool.get_cached_block
        for i in range(min(len(block_hashes), max_length // self.block_size)):
            block = get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing to release: full attention reads the whole context at every step."""
