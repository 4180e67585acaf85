"""CrossAttentionManager: the blocks that hold one request's encoder output, for its decoder's cross-attention.

    encoder prompt (E tokens) ──encoder──▶ K/V of every decoder layer's cross-attention, written once
    request's block list (bs = block_size):   [ c0 | c1 | ... | c(cdiv(E, bs) - 1) ]
                                               taken at admission, read by every decode step,
                                               given back at finish / abort / preemption

The coordinator asks this group for the encoder's E tokens, never the decoder's length (coordinator.py
NOTE 1), so `num_tokens` here is always E.

NOTEs:
1. Allocated once, never grown: the first allocation takes cdiv(E, bs) blocks; every later call for the
   same request finds them held and takes none. A call asking for more than the request holds means the
   encoder length changed under a running request -- a bug upstream -- and fails loudly.
2. Never prefix-cached: the blocks hold the encoder output of one request's whole encoder prompt, keyed by
   nothing the request's (decoder) block hashes describe, so `cache_blocks` registers nothing and
   `find_longest_cache_hit` always misses -- which also makes the request miss in every other group (the
   coordinator's fixed point), as vLLM disables prefix caching for encoder-decoder models. A request whose
   decoder prompt matches another's under a different encoder prompt can never read the other's blocks.
3. Preemption frees the blocks (the request restarts at num_computed_tokens == 0); the runner then runs the
   encoder again in the request's next first step, so recompute writes the same K/V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.api import CrossAttentionSpec
from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase, cdiv

if TYPE_CHECKING:
    from pagedllm.api import KVCacheSpec
    from pagedllm.api.kv import BlockPool


class CrossAttentionManager(SingleTypeKVCacheManagerBase):
    """KV manager for cross-attention layers: cdiv(encoder length, block_size) blocks per request, fixed."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if not isinstance(spec, CrossAttentionSpec):
            raise ValueError(f"CrossAttentionManager needs a CrossAttentionSpec, got {type(spec).__name__}")
        super().__init__(spec, block_pool, group_id)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """All of the encoder's blocks for a request that holds none yet, else none (NOTE 1)."""
        assert not new_computed_blocks, "cross-attention blocks are never prefix hits (NOTE 2)"
        if request_id in self.req_to_blocks:
            self._check_unchanged(request_id, num_tokens)
            return 0
        return cdiv(num_tokens, self.block_size)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The encoder's blocks at the request's first allocation; nothing afterwards (NOTE 1)."""
        if request_id in self.req_to_blocks:
            self._check_unchanged(request_id, num_tokens)
            return []
        blocks = self.block_pool.get_new_blocks(cdiv(num_tokens, self.block_size)) if num_tokens else []
        self.req_to_blocks[request_id] = blocks
        return list(blocks)

    def _check_unchanged(self, request_id: str, num_tokens: int) -> None:
        held = len(self.req_to_blocks[request_id])
        if cdiv(num_tokens, self.block_size) != held:
            raise RuntimeError(
                f"request {request_id}: cross-attention holds {held} blocks for its encoder output, but "
                f"{num_tokens} encoder tokens were asked for; the encoder prompt cannot change while it runs"
            )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Nothing to attach: there are never hits (NOTE 2)."""
        assert not new_computed_blocks, "cross-attention blocks are never prefix hits (NOTE 2)"

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Nothing is registered: the blocks are one request's encoder output (NOTE 2)."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Always a miss (NOTE 2)."""
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing to release early: every decode step reads the whole encoder output."""
