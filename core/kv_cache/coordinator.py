"""KVCacheCoordinator: one single-type manager per KV-cache group, all drawing from one BlockPool.

A model whose layers are all alike has one group (the unitary case). A hybrid model (say full attention plus
sliding window, or attention plus Mamba) has one group per layer type; a request then holds one block list
per group, and a prefix is reusable only if *every* group can reuse it.

Request hashes are computed once, at the smallest block size of any group (`hash_block_size`); every other
group's block size must be a multiple of it. Because hashes are chained, the hash of the last small block
inside a big block identifies the big block's whole prefix, so a group with k times the block size reads
every k-th hash (`group_hashes`).

NOTE 1: an encoder-decoder model's cross-attention group holds the encoder output, not the request's own
tokens, so each group is sized by its spec's `tokens_to_hold(num_tokens, num_encoder_tokens)`: the decoder
length for self-attention groups, the encoder length for a CrossAttentionSpec group. The managers keep the
protocol's one token count; only the coordinator knows both. A cross-attention manager never reports a
prefix hit, so the fixed point below makes an encoder-decoder request always miss: the decoder's blocks
alone do not identify the prefix (two requests may share a decoder prompt under different encoder prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.protocols.kv_manager import SingleTypeKVCacheManager

if TYPE_CHECKING:
    from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig
    from pagedllm.kv_cache.spec import KVCacheSpec

# Builds the manager of one group: (the group's spec, the shared pool, the group's id).
ManagerFactory = Callable[["KVCacheSpec", BlockPool, int], SingleTypeKVCacheManager]

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one block list per group, in group order


class KVCacheCoordinator:
    """Fans each KV operation out to the groups' managers; finds prefix hits every group agrees on."""

    def __init__(
        self, config: KVCacheConfig, manager_factories: Sequence[ManagerFactory], enable_caching: bool
    ) -> None:
        if not config.groups:
            raise ValueError("a KV cache needs at least one group")
        if len(manager_factories) != len(config.groups):
            raise ValueError(
                f"{len(config.groups)} KV-cache groups but {len(manager_factories)} manager factories"
            )
        self.block_pool = BlockPool(config.num_blocks, enable_caching)
        self.block_sizes = [group.spec.block_size for group in config.groups]
        self.hash_block_size = min(self.block_sizes)
        for size in self.block_sizes:
            if size % self.hash_block_size:
                raise ValueError(f"KV block sizes {self.block_sizes} must all be multiples of the smallest")
        self._hash_strides = [size // self.hash_block_size for size in self.block_sizes]
        self._group_specs = [group.spec for group in config.groups]
        self.managers: list[SingleTypeKVCacheManager] = [
            factory(group.spec, self.block_pool, gid)
            for gid, (factory, group) in enumerate(zip(manager_factories, config.groups, strict=True))
        ]

    @property
    def num_groups(self) -> int:
        """KV-cache groups, one manager each."""
        return len(self.managers)

    def group_hashes(self, group_id: int, block_hashes: list[bytes]) -> list[bytes]:
        """The request's hashes at `group_id`'s block size (the input list itself when sizes agree)."""
        k = self._hash_strides[group_id]
        return block_hashes if k == 1 else block_hashes[k - 1 :: k]

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> tuple[GroupBlocks, int]:
        """Per-group hit blocks and the hit length in tokens (a multiple of every group's block size).

        Hybrid case: a group may only reuse a shorter prefix than another, and for some layer types
        (sliding window) the blocks to reuse depend on the length asked for, so a hit cannot just be
        truncated. Ask the groups in turn, each at the shortest length found so far, until a whole pass
        lowers nothing: in that pass every group was asked for, and returned, exactly `hit_length` tokens.
        """
        if self.num_groups == 1:
            hits = self.managers[0].find_longest_cache_hit(block_hashes, max_length)
            return (hits,), len(hits) * self.block_sizes[0]
        hit_length = max_length
        while True:
            asked = hit_length
            results: list[list[KVCacheBlock]] = []
            for gid, manager in enumerate(self.managers):
                hits = manager.find_longest_cache_hit(self.group_hashes(gid, block_hashes), hit_length)
                length = len(hits) * self.block_sizes[gid]
                assert length <= hit_length, f"group {gid} returned a hit longer than asked for"
                if length == 0:  # a miss in any group is a miss for all: no need to ask the others
                    return tuple([] for _ in self.managers), 0
                results.append(hits)
                hit_length = length
            if hit_length == asked:
                return tuple(results), hit_length

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks, num_encoder_tokens: int = 0
    ) -> int:
        """Free blocks needed, over all groups, for the request to hold `num_tokens` tokens (and, in a
        cross-attention group, its `num_encoder_tokens` encoder tokens: NOTE 1)."""
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id, self._tokens_to_hold(gid, num_tokens, num_encoder_tokens), new_computed_blocks[gid]
            )
            for gid, manager in enumerate(self.managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        """Attach (already touched) prefix hits to the request, group by group."""
        for gid, manager in enumerate(self.managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[gid])

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0) -> GroupBlocks:
        """Grow every group's block list to `num_tokens` tokens (a cross-attention group's to the encoder's
        `num_encoder_tokens`: NOTE 1); return the added blocks per group."""
        return tuple(
            manager.allocate_new_blocks(request_id, self._tokens_to_hold(gid, num_tokens, num_encoder_tokens))
            for gid, manager in enumerate(self.managers)
        )

    def _tokens_to_hold(self, gid: int, num_tokens: int, num_encoder_tokens: int) -> int:
        return self._group_specs[gid].tokens_to_hold(num_tokens, num_encoder_tokens)

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Register the request's blocks that are full within `num_tokens` tokens, in every group."""
        for gid, manager in enumerate(self.managers):
            manager.cache_blocks(request_id, self.group_hashes(gid, block_hashes), num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Let each group give back blocks it no longer needs (sliding window)."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Give back every block the request holds, in every group."""
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's block list in each group."""
        return tuple(manager.get_blocks(request_id) for manager in self.managers)
