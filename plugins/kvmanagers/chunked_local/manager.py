"""ChunkedLocalManager: a layer reads only its own chunk of `attention_chunk_size` (C) positions (Llama 4).

Chunk rule (the backends' mask, and transformers' create_chunked_causal_mask): the token at position q attends
to key positions p with  p // C == q // C  and  p <= q. Once n tokens are computed the next token to compute
is at position n, and no later token reads a position before its chunk's start, (n // C) * C:

    positions:  [ 0 ....... C-1 | C ...... 2C-1 | 2C ... n-1  n ... ]      (here n // C == 2)
    blocks:     [ released ................... ][ still read ........]    bs = block_size
                 0 .. (n // C) * C // bs - 1      from (n // C) * C // bs on

NOTE 1: the blocks wholly before the chunk's start, [0, ((n // C) * C) // bs), are released as the request
runs (`remove_skipped_blocks`) and replaced by the pool's null block: block lists stay append-only and
index-aligned with positions, as in the sliding-window manager. When C is not a multiple of bs, the block
holding a chunk's start also holds the previous chunk's tail; it is kept until the next chunk starts.
NOTE 2: the released region is one run [0, x): each call walks right to left from the newly skipped end and
stops at the first null block, so each call costs only the blocks it releases.
NOTE 3: prefix hits (vLLM's ChunkedLocalAttentionManager). A hit of k blocks resumes at position k * bs,
which reads the positions [((k * bs) // C) * C, k * bs): those blocks must be cached, every earlier one
is never read and comes back as the null block (not held, no KV needed). Asked for at most L blocks, the
longest hit is the chunk of L * bs's start plus the cached run from there; a miss right at a block that
also holds the previous chunk's tail (C not a multiple of bs) makes that run empty and the hit's end fall
inside the previous chunk, so the look-up is repeated there, with the smaller L.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.api import ChunkedLocalAttentionSpec
from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase

if TYPE_CHECKING:
    from pagedllm.api import KVCacheSpec
    from pagedllm.api.kv import BlockPool


class ChunkedLocalManager(SingleTypeKVCacheManagerBase):
    """KV manager for chunked local attention: a request holds about C / block_size + 1 blocks."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if not isinstance(spec, ChunkedLocalAttentionSpec) or spec.attention_chunk_size < 1:
            raise ValueError(
                f"ChunkedLocalManager needs a ChunkedLocalAttentionSpec with attention_chunk_size >= 1, got {spec}"
            )
        super().__init__(spec, block_pool, group_id)
        self.chunk_size = spec.attention_chunk_size

    def _chunk_start_block(self, position: int) -> int:
        """The block holding the first position of `position`'s chunk."""
        return position // self.chunk_size * self.chunk_size // self.block_size

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix (<= max_length) whose blocks from its end's chunk start on are cached (NOTE 3).

        Blocks before that chunk start are the null block. Looks up at most C / block_size + 1 hashes per pass.
        """
        max_num_blocks = min(len(block_hashes), max_length // self.block_size)
        null = self.block_pool.null_block
        get_cached_block = self.block_pool.get_cached_block
        while True:
            first = self._chunk_start_block(max_num_blocks * self.block_size)
            hits: list[KVCacheBlock] = [null] * first
            for i in range(first, max_num_blocks):
                block = get_cached_block(block_hashes[i], self.group_id)
                if block is None:
                    break
                hits.append(block)
            length = len(hits)
            # A hit reaching past block `first` ends in the same chunk as max_num_blocks, so it reads only blocks
            # `first` on, all cached; one of nulls only is sound when it ends exactly at a chunk's start.
            if length == 0 or self._chunk_start_block(length * self.block_size) == first:
                return hits
            # The hit ends inside the previous chunk (C not a multiple of bs): its blocks from that chunk's start
            # are needed and were not looked up; ask again for at most `length` blocks.
            max_num_blocks = length

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace the blocks wholly before the chunk of position num_computed_tokens by the null block."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful_token = num_computed_tokens // self.chunk_size * self.chunk_size
        num_skipped = min(first_useful_token // self.block_size, len(blocks))
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped - 1, -1, -1):  # NOTE 1, NOTE 2
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        # Tail first (the order `removed` is in), as in free(): a cached prefix is evicted from its end.
        self.block_pool.free_blocks(removed)
