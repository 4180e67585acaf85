"""SinkWindowManager: a sliding window whose first `num_sink_tokens` tokens stay readable (StreamingLLM sinks).

Attention rule the layers apply: the token at position q attends to key positions p with
    p < num_sink_tokens   or   q - window < p <= q.
So a request's blocks split in three, once n tokens are computed (bs = block_size, S = sink blocks):

    blocks:  [ 0 .. S-1 ][ S .. skipped-1 ][ skipped .. ]        S = ceil(num_sink_tokens / bs)
               pinned       released          the window         skipped = (n - window + 1) // bs
             (never freed  (the null block)   (still read)
              mid-request)

NOTE 1: the sink blocks are released only by `free` (finish, abort, preemption); `remove_skipped_blocks`
never touches them, so a request always holds S + the window's blocks. Released blocks become the pool's null
block, as in the sliding-window manager: the block list stays append-only and index-aligned with positions.
NOTE 2: the released region is one run [S, x): each call walks right to left from the newly skipped end and
stops at the first null block, so each call costs only the blocks it releases.
NOTE 3: a prefix hit of L blocks needs the sink blocks (those below L) and the last
ceil((window - 1) / bs) blocks before position L * bs cached; the blocks between are never read again and
come back as the null block (not held).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.api import SinkSlidingWindowSpec
from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase, cdiv

if TYPE_CHECKING:
    from pagedllm.api import KVCacheSpec
    from pagedllm.api.kv import BlockPool


class SinkWindowManager(SingleTypeKVCacheManagerBase):
    """KV manager for sink + sliding-window attention: a request holds S + about window / bs + 1 blocks."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if not isinstance(spec, SinkSlidingWindowSpec) or spec.sliding_window < 1 or spec.num_sink_tokens < 0:
            raise ValueError(
                f"SinkWindowManager needs a SinkSlidingWindowSpec with a window >= 1 and num_sink_tokens >= 0, "
                f"got {spec}"
            )
        super().__init__(spec, block_pool, group_id)
        self.sliding_window = spec.sliding_window
        self.num_sink_blocks = cdiv(spec.num_sink_tokens, self.block_size)
        self.contiguous_blocks_for_hit = cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix (<= max_length blocks' worth) that NOTE 3 allows; unneeded blocks are null."""
        max_num_blocks = min(len(block_hashes), max_length // self.block_size)
        cached = [self.block_pool.get_cached_block(h, self.group_id) for h in block_hashes[:max_num_blocks]]
        lead = 0  # cached blocks from block 0 on
        while lead < max_num_blocks and cached[lead] is not None:
            lead += 1
        window = self.contiguous_blocks_for_hit
        run = 0  # cached blocks ending at block length - 1, as `length` falls
        runs = [0] * max_num_blocks
        for i in range(max_num_blocks):
            run = run + 1 if cached[i] is not None else 0
            runs[i] = run
        null = self.block_pool.null_block
        for length in range(max_num_blocks, 0, -1):
            sinks_cached = lead >= min(self.num_sink_blocks, length)
            if sinks_cached and runs[length - 1] >= min(window, length):
                first_window_block = length - window
                return [
                    block if (i < self.num_sink_blocks or i >= first_window_block) and block is not None else null
                    for i, block in enumerate(cached[:length])
                ]
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks wholly before position num_computed_tokens - window + 1, except the sink blocks."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        num_skipped = min(max(first_useful_token, 0) // self.block_size, len(blocks))
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped - 1, self.num_sink_blocks - 1, -1):  # NOTE 1, NOTE 2
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(removed)  # tail first, as in free()
