"""BlockPool: every KV block of the cache, their ref counts, the free queue and the prefix-cache index.

NOTEs (the why behind the rules):

1. Block 0 is the null block. It is taken out of the free queue at start and never handed out or
   ref-counted; managers use it as a placeholder where a block-table slot must exist but holds nothing
   (a sliding window's dropped blocks). Every method here skips it.
2. The free queue is the eviction order. A block whose ref count drops to 0 keeps its hash and stays
   findable by `get_cached_block` until `get_new_blocks` pops it, so "free" and "cached" overlap: a free
   cached block is an eviction candidate, and a prefix hit on it takes it back out of the queue (`touch`).
3. Freed *cached* blocks go to the tail, so the head holds the least recently used one: FIFO over freeing
   time is LRU eviction. Callers free a request's blocks in reverse order, so a prefix's tail blocks are
   evicted before its head: eviction eats a cached prefix from its end, so a later request sharing only
   the first blocks still hits them (a hit is a *leading* run of hashes; a hole at the front would waste
   everything behind it).
4. Freed *uncached* blocks (no hash: a partial last block, or caching disabled) go to the head instead:
   their contents are worthless, so they are reused first (LIFO), leaving cached blocks in the cache longer.
5. No de-duplication: when a block becomes full with content identical to an existing cached block, both
   stay cached under the same hash. Swapping the new block for the old one would change a block id the
   model runner already holds; block tables are append-only.
6. A block's hash is set once, when it becomes full and registered, and cleared only when it is evicted
   (popped for reuse) or the whole cache is reset. Its KV is then never rewritten while findable.
7. Hashes are keyed by (group id, hash): KV-cache groups with different layer types store different data
   for the same tokens, so a hit must come from the group that asks.
8. `evict_listener` (a KV connector's `on_device_evict`, when one is configured) hears each cached block as
   it is evicted, with its hash and id: the block's KV is still intact then (its new owner writes it in a
   later forward), so a host tier can copy it out before that forward. None costs one check per eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pagedllm.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock


@dataclass
class BlockPoolCounters:
    """Totals since the pool was built (or the counters were reset), for stats and tests."""

    blocks_allocated: int = 0  # blocks handed out by get_new_blocks
    blocks_cached: int = 0  # blocks registered under a hash by cache_full_blocks
    blocks_evicted: int = 0  # cached blocks whose hash was dropped to reuse the block
    prefix_cache_resets: int = 0


class BlockPool:
    """All KV blocks of one cache, shared by every KV-cache group (see the NOTEs at the top of this file)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # (group id, hash) -> {block id: block}; several blocks may share one hash (NOTE 5).
        self.cached_block_hash_to_block: dict[tuple[int, bytes], dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()  # NOTE 1
        self.null_block.is_null = True
        self.counters = BlockPoolCounters()
        self.evict_listener: Callable[[bytes, int, int], None] | None = None  # (hash, block id, group id): NOTE 8

    # -- allocation ------------------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the queue head, each with ref_cnt 1 and no hash.

        A cached block taken this way is evicted from the prefix cache first. Raises ValueError when fewer
        than `num_blocks` are free (callers check `get_num_free_blocks` beforehand).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            assert block.ref_cnt == 0, f"{block} was in the free queue while held"
            block.ref_cnt = 1
        self.counters.blocks_allocated += num_blocks
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); ref-0 blocks leave the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)  # NOTE 2
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 become free, in the given eviction order.

        Pass a request's blocks tail first (NOTE 3).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"{block} freed more often than it was taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)  # NOTE 4
                else:
                    self.free_block_queue.append(block)  # NOTE 3

    # -- prefix cache ------------------------------------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        """A block registered under `block_hash` for `group_id`, or None on a miss."""
        entries = self.cached_block_hash_to_block.get((group_id, block_hash))
        if not entries:
            return None
        return next(iter(entries.values()))

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under `block_hashes` at the same positions.

        `blocks` is one request's block list in one group; the first `num_cached_blocks` are already
        registered and the range up to `num_full_blocks` has just become full (its KV is being written by
        the step being scheduled). Null blocks are skipped. No-op when caching is disabled.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, "block hashes must cover every full block"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"{block} is already cached (NOTE 6)"
            block.block_hash = block_hashes[i]
            block.group_id = group_id
            key = (group_id, block.block_hash)
            self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block
            self.counters.blocks_cached += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, so nothing hits any more (e.g. after a weight update); False while blocks are held."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        self.counters.prefix_cache_resets += 1
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        key = (block.group_id, block.block_hash)
        entries = self.cached_block_hash_to_block[key]
        del entries[block.block_id]
        if not entries:
            del self.cached_block_hash_to_block[key]
        if self.evict_listener is not None:
            self.evict_listener(block.block_hash, block.block_id, block.group_id)  # NOTE 8
        block.reset_hash()
        self.counters.blocks_evicted += 1

    # -- occupancy ---------------------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out now (free cached blocks included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests, 0.0 to 1.0."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable
