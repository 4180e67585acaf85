"""MambaManager: a Mamba layer keeps one fixed-size recurrent state per request, so a request holds one block.

    request's block list (block_size bs, n tokens):   [ S | null | null | ... ]   cdiv(n, bs) entries
                                                         ^ the state slot: the only real block, taken at
                                                           admission, given back at finish/abort/preemption

NOTEs:
1. The list is padded with the pool's null block (block 0) so it stays index-aligned with positions like an
   attention group's list: the model runner's shared block-table and slot-mapping code then works unchanged
   (its slot_mapping for Mamba rows points into the null block, which a Mamba layer never reads). Null blocks
   are not ref-counted and cost no memory, so a request's memory never grows with its length.
2. No prefix caching: a block holds the state *after the request's last computed token*, not the KV of a
   fixed run of tokens, so it cannot be shared by another request whose prompt merely starts the same way
   (it would need the state at exactly the hit length). `find_longest_cache_hit` reports no hit, which makes
   the whole request miss in a hybrid model too (the coordinator's fixed point). vLLM does the same by
   default; caching states at block boundaries would be a later addition.
3. Preemption frees the state; the request restarts from num_computed_tokens == 0, which the Mamba layer
   reads as "fresh state" (zeros), so recompute reproduces the same state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.api import MambaSpec
from pagedllm.api.kv import KVCacheBlock, SingleTypeKVCacheManagerBase, cdiv

if TYPE_CHECKING:
    from pagedllm.api import KVCacheSpec
    from pagedllm.api.kv import BlockPool


class MambaManager(SingleTypeKVCacheManagerBase):
    """KV manager for Mamba layers: exactly one real block (the state slot) per request."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if not isinstance(spec, MambaSpec):
            raise ValueError(f"MambaManager needs a MambaSpec, got {type(spec).__name__}")
        super().__init__(spec, block_pool, group_id)

    def _holds_state(self, request_id: str) -> bool:
        blocks = self.req_to_blocks.get(request_id)
        return bool(blocks) and not blocks[0].is_null  # type: ignore[index]

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """One block (the state) for a request that holds none yet, else none: the state never grows."""
        return 0 if self._holds_state(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Take the state block at admission, then pad with null blocks to cover `num_tokens` (NOTE 1)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new = [] if self._holds_state(request_id) else self.block_pool.get_new_blocks(1)
        num_pad = max(cdiv(num_tokens, self.block_size), 1) - len(blocks) - len(new)
        new += [self.block_pool.null_block] * max(num_pad, 0)
        blocks.extend(new)
        return new

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Nothing is registered: a state block is not the KV of a prefix (NOTE 2)."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Always a miss (NOTE 2)."""
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing to release early: the one state block is needed until the request ends."""
