"""SlidingWindowManager: a layer reads only the last `sliding_window` positions, so older blocks are released.

Window rule (the backends' mask, and transformers'): the token at position q attends to key positions p with
q - window < p <= q. Once `n` tokens are computed, the next token to compute is at position n and the earliest
position any later token reads is n - window + 1, so the blocks wholly before it,
[0, (n - window + 1) // block_size), are never read again.

Released blocks are replaced by the pool's null block (block 0), not removed: block lists stay append-only and
index-aligned with positions (the model runner keeps its own copy of each block table). The runner's copy
still names the released block; that is sound because a released block only ever sits at positions the
attention mask excludes, and slots are written only at the positions being computed, which are in-window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.api import SlidingWindowSpec
from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase, cdiv

if TYPE_CHECKING:
    from pagedllm.api import KVCacheSpec
    from pagedllm.api.kv import BlockPool


class SlidingWindowManager(SingleTypeKVCacheManagerBase):
    """KV manager for sliding-window attention: a request holds about window / block_size + 1 blocks."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if not isinstance(spec, SlidingWindowSpec) or spec.sliding_window < 1:
            raise ValueError(f"SlidingWindowManager needs a SlidingWindowSpec with a window >= 1, got {spec}")
        super().__init__(spec, block_pool, group_id)
        self.sliding_window = spec.sliding_window
        # A prefix hit of k blocks resumes at position k * block_size, which reads the window - 1 positions
        # before it: the hit's last ceil((window - 1) / block_size) blocks must all be cached; earlier
        # blocks are never read and may be null.
        self.contiguous_blocks_for_hit = cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix (<= max_length) whose last `contiguous_blocks_for_hit` blocks are cached.

        Scans from the right and stops at the first run long enough, so the longest hit wins. Blocks before
        the run are the null block (not read, so no KV needed). If no run is long enough, a leading run that
        starts at block 0 is still a hit: those tokens have no earlier context to miss.
        """
        max_num_blocks = min(len(block_hashes), max_length // self.block_size)
        null = self.block_pool.null_block
        if self.contiguous_blocks_for_hit == 0:  # window 1: a token reads only itself
            return [null] * max_num_blocks
        hits: list[KVCacheBlock] = [null] * max_num_blocks
        get_cached_block = self.block_pool.get_cached_block
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self.contiguous_blocks_for_hit:
                # Blocks i .. i+run-1 are the run; anything to the right of it was a shorter run that a miss
                # cut off, so it is dropped: [null, null, 8, 3, null, 9] -> [null, null, 8, 3].
                return hits[: i + run]
        # No run long enough: `run` now counts the cached blocks starting at block 0.
        return hits[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace the blocks wholly before position num_computed_tokens - window + 1 by the null block."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        num_skipped = min(max(first_useful_token, 0) // self.block_size, len(blocks))
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        # Right to left, stopping at the first null block: earlier calls (or a prefix hit) nulled everything
        # before it already, so each call costs only the blocks it actually releases.
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        # Tail first (the order `removed` is in), as in free(): a cached prefix is evicted from its end.
        self.block_pool.free_blocks(removed)
