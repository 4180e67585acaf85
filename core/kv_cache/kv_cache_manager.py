"""KVCacheManager: the scheduler's one door to the KV cache (prefix hits, slots for new tokens, freeing).

Layering, as in vLLM V1: Scheduler -> KVCacheManager -> KVCacheCoordinator -> one single-type manager per
KV-cache group -> BlockPool. The scheduler sees only requests, token counts and `KVCacheBlocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.coordinator import KVCacheCoordinator, ManagerFactory
from pagedllm.kv_cache.hashing import update_block_hashes
from pagedllm.kv_cache.single_type_manager import SingleTypeKVCacheManagerBase
from pagedllm.kv_cache.spec import CrossAttentionSpec

if TYPE_CHECKING:
    from pagedllm.kv_cache.spec import KVCacheSpec
    from pagedllm.request import Request


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table because they share one spec (same layer type and block size)."""

    spec: KVCacheSpec
    layer_indices: list[int]


@dataclass(frozen=True)
class KVCacheConfig:
    """How the KV cache is laid out: the block count of the pool and the groups drawing from it."""

    num_blocks: int
    groups: list[KVCacheGroup]


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks of one request, one list per KV-cache group; what the scheduler gets instead of the allocator.

    `KVCacheBlocks()` (no groups) is the empty value: it behaves as "no blocks in any group".
    """

    blocks: tuple[list[KVCacheBlock], ...] = ()

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        """No blocks in each of `num_groups` groups."""
        return cls(tuple([] for _ in range(num_groups)))

    def get_block_ids(self) -> list[list[int]]:
        """Block ids per group, in block-table order."""
        return [[block.block_id for block in group] for group in self.blocks]

    def num_blocks(self) -> int:
        """Blocks over all groups."""
        return sum(len(group) for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Group-wise concatenation; the empty value is the identity."""
        if not self.blocks:
            return other
        if not other.blocks:
            return self
        if len(self.blocks) != len(other.blocks):
            raise ValueError(f"cannot add blocks of {len(self.blocks)} and {len(other.blocks)} groups")
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))


# What allocate_slots returns when a one-group request got no new blocks (shared: callers only read it).
_NO_NEW_BLOCKS = KVCacheBlocks(([],))


@dataclass
class PrefixCacheStats:
    """Prefix-cache look-ups since the last reset: requests looked up, their tokens, the tokens found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens found in the cache (0.0 when nothing was looked up)."""
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        """Start counting from zero."""
        self.requests = self.queries = self.hits = 0


class KVCacheManager:
    """Prefix-cache look-up and block allocation for the scheduler.

    `manager_factories` has one entry per group of `config` (the engine picks each group's manager class from
    its spec through the plugin selector).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        manager_factories: Sequence[ManagerFactory],
        enable_caching: bool = True,
        *,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.coordinator = KVCacheCoordinator(config, manager_factories, enable_caching)
        self.block_pool = self.coordinator.block_pool
        # Request hashes are kept at one block size, the smallest of the groups (see coordinator.py).
        self.block_size = self.coordinator.hash_block_size
        self.prefix_cache_stats = PrefixCacheStats()
        # The one group's manager when there is one group (the decode fast path needs no coordination).
        self._single = self.coordinator.managers[0] if self.coordinator.num_groups == 1 else None
        if isinstance(config.groups[0].spec, CrossAttentionSpec):
            self._single = None  # the fast path counts the request's own tokens (coordinator.py NOTE 1)
        self._single_base = (
            self._single if isinstance(self._single, SingleTypeKVCacheManagerBase) else None
        )

    @property
    def num_groups(self) -> int:
        """KV-cache groups (one block table per group per request)."""
        return self.coordinator.num_groups

    def empty_blocks(self) -> KVCacheBlocks:
        """No blocks, shaped for this cache's groups."""
        return KVCacheBlocks.empty(self.num_groups)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a request that holds no blocks, and its length in tokens.

        The length is a multiple of the block size and at most `request.num_tokens - 1`: the last token is
        always recomputed, because the step needs its logits to sample the next token. The blocks are not
        ref-counted yet: pass them to `allocate_slots` before any other allocation, or a free hit block may
        be evicted in between. Empty when caching is off. The lookup counts in the prefix-cache stats
        only when allocate_slots admits the request, so a request that waits several steps counts once.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position's hidden state, so nothing may be skipped (as vLLM);
            # the blocks this request computes are still cached for the others.
            return self.empty_blocks(), 0
        update_block_hashes(request, self.block_size)
        max_length = max(request.num_tokens - 1, 0)
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_reserved_blocks: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Give the request slots for `num_new_tokens` more tokens (after its prefix hits, if any).

        ```
                 |<------ comp ------>|<---- new_comp ---->|<------------ new ------------>|
        tokens   0                    C                   C+H                    C+H+N = need
        blocks   |<------ held ------>|<------ hits ------>|<------- allocated now ------->|
                 |<------------- registered in the prefix cache after this call -------->|
                                               (blocks full within need, with a hash known)

        comp      request.num_computed_tokens (C): tokens whose KV the request's blocks hold, or will
                  hold once the step already scheduled ran. The scheduler moves it; this method never does.
        new_comp  num_new_computed_tokens (H): the prefix hit found by get_computed_blocks, whose blocks
                  are `new_computed_blocks`. Only a request that holds no blocks has one (then C == 0).
        new       num_new_tokens (N): tokens the coming step computes and writes.
        need      slots the request holds after this call: C + H + N, capped at max_model_len.
        held      blocks the request already holds; its last one may be partly empty and take new tokens.
        allocated cdiv(need, bs) - held - hits fresh blocks from the free-queue head (none if <= 0).
        registered  the first min(need, len(request.block_hashes) * bs) // bs blocks get their hash now,
                  though the coming step writes their KV. A request admitted later in the same step may
                  hit them: it reads them in that same forward pass, which is sound because attention
                  writes a layer's new KV for the whole batch before any request reads that layer.
        bs        block size (the smallest over the groups; each group counts in its own block size).
        reserved  num_reserved_blocks: free blocks this call must leave free (the scheduler's admission
                  headroom for requests already running); 0 for running requests themselves.
        delay     delay_cache_blocks: register nothing now. For blocks a KV connector fills in the background
                  (sched/base.py park_for_external_load): no other request may hit them before their KV lands;
                  the request's next allocation, once it is scheduled, registers them.
        ```

        Returns the newly allocated blocks per group (hits are not included), or None when the free blocks
        cannot cover `need`. Hit blocks that are free right now (ref_cnt 0, evictable) count against the
        free blocks, since using them takes them out of the free queue. On None, no block, ref count, hash
        or request field has changed (a sliding-window manager may still have released blocks the request
        can no longer read).
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if new_computed_blocks is None and not num_new_computed_tokens and self._single is not None \
                and not num_reserved_blocks:
            grown = self._grow_within_held(request, num_new_tokens)
            if grown is not None:
                return grown
        hit_blocks = self._hit_blocks(new_computed_blocks, num_new_computed_tokens)
        rid = request.request_id
        need = min(request.num_computed_tokens + num_new_computed_tokens + num_new_tokens, self.max_model_len)

        # Free what the request can no longer read first, so it counts as free below.
        self.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_encoder = request.num_encoder_tokens  # sizes a cross-attention group (coordinator.py NOTE 1)
        num_to_allocate = self.coordinator.get_num_blocks_to_allocate(rid, need, hit_blocks, num_encoder)
        if num_to_allocate + num_reserved_blocks > self.block_pool.get_num_free_blocks():
            return None

        # Touch hits before allocating: a free hit block sits in the free queue and would otherwise be
        # handed out (and its hash evicted) as one of this very request's new blocks.
        for group in hit_blocks:
            self.block_pool.touch(group)
        self.coordinator.save_new_computed_blocks(rid, hit_blocks)
        new_blocks = self.coordinator.allocate_new_blocks(rid, need, num_encoder)

        if self.enable_caching:
            if request.num_computed_tokens == 0:
                # Admission (first allocation since arrival or preemption): count the prefix lookup once.
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
            if delay_cache_blocks:
                return KVCacheBlocks(new_blocks)
            update_block_hashes(request, self.block_size)
            num_cacheable = min(need, len(request.block_hashes) * self.block_size)
            self.coordinator.cache_blocks(rid, request.block_hashes, num_cacheable)
        return KVCacheBlocks(new_blocks)

    def _grow_within_held(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """The decode fast path: a running request (one KV-cache group, no prefix hits) that grows.

        The same steps as the general path, minus the ones that are no-ops here (no hits to touch or save,
        no admission stats): when its held blocks already cover the new tokens (15 of 16 decode steps at
        block size 16) nothing is allocated at all; otherwise its manager allocates directly. The general
        path's layers cost ~25 µs per request per step in Python. None means "take the general path" (it
        then finds the same answer, including "out of blocks").
        """
        num_computed = request.num_computed_tokens
        if not num_computed:
            return None  # admission: the general path counts the prefix-cache lookup
        manager = self._single
        assert manager is not None
        rid = request.request_id
        need = num_computed + num_new_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        manager.remove_skipped_blocks(rid, num_computed)
        block_size = self.block_size
        base = self._single_base  # the same manager when it keeps the base class's tables (read directly)
        blocks = base.req_to_blocks.get(rid) if base else manager.get_blocks(rid)
        if not blocks:
            return None
        new_blocks: list[KVCacheBlock] = []
        if need > len(blocks) * block_size:
            # A block fills (1 decode step in block_size): with one group and no hits, the general path's
            # allocation is just these two calls of the group's manager.
            if manager.get_num_blocks_to_allocate(rid, need, []) > self.block_pool.get_num_free_blocks():
                return None
            new_blocks = manager.allocate_new_blocks(rid, need)
        if self.enable_caching:
            hashes = request.block_hashes
            # update_block_hashes' own early exit, without its call: most decode steps fill no block.
            if (len(request.prompt_token_ids) + len(request.output_token_ids)) // block_size > len(hashes):
                update_block_hashes(request, block_size)
            num_hashed_tokens = len(hashes) * block_size
            num_cacheable = need if need < num_hashed_tokens else num_hashed_tokens
            # cache_blocks' own early exit (no block newly full and hashed), without its call.
            if base is None or num_cacheable // block_size > base.num_cached_block.get(rid, 0):
                manager.cache_blocks(rid, hashes, num_cacheable)
        return KVCacheBlocks((new_blocks,)) if new_blocks else _NO_NEW_BLOCKS

    def free(self, request: Request) -> None:
        """Give back every block of the request (finished, aborted or preempted); its tail blocks are evicted first."""
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """All blocks the request holds, per group."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table per group (empty lists if it holds no blocks)."""
        return [[block.block_id for block in group] for group in self.coordinator.get_blocks(request_id)]

    def take_new_block_ids(self, request_id: str, num_sent: list[int]) -> list[list[int]]:
        """The ids of the request's blocks past the first `num_sent[g]` of each group, and `num_sent` moved
        to the current lengths (in place).

        Block lists only grow while a request holds them (single_type_manager.py), so a caller that keeps
        one count per group learns each block once: a decode step that filled no block costs a length
        compare instead of a copy of the whole table (the scheduler sends the runner only appended ids).
        """
        single = self._single
        if single is not None:
            base = self._single_base
            blocks = base.req_to_blocks.get(request_id, []) if base else single.get_blocks(request_id)
            start = num_sent[0]
            if len(blocks) == start:
                return [[]]
            num_sent[0] = len(blocks)
            return [[block.block_id for block in blocks[start:]]]
        out = []
        for g, group in enumerate(self.coordinator.get_blocks(request_id)):
            start = num_sent[g]
            out.append([block.block_id for block in group[start:]])
            num_sent[g] = len(group)
        return out

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (0.0 to 1.0); cached free blocks count as free."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can still be allocated (free cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache stats since the last call; the running totals restart from zero."""
        stats = replace(self.prefix_cache_stats)
        self.prefix_cache_stats.reset()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update); False (and nothing done) while blocks are held."""
        return self.block_pool.reset_prefix_cache()

    def _hit_blocks(
        self, new_computed_blocks: KVCacheBlocks | None, num_new_computed_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        if new_computed_blocks is None or not new_computed_blocks.blocks:
            if num_new_computed_tokens:
                raise ValueError("num_new_computed_tokens > 0 needs the new_computed_blocks that cover them")
            return self.empty_blocks().blocks
        hits = new_computed_blocks.blocks
        if len(hits) != self.num_groups:
            raise ValueError(f"new_computed_blocks has {len(hits)} groups, the cache has {self.num_groups}")
        for group, size in zip(hits, self.coordinator.block_sizes, strict=True):
            if len(group) * size != num_new_computed_tokens:
                raise ValueError(
                    f"{len(group)} hit blocks of {size} tokens do not make {num_new_computed_tokens} tokens"
                )
        if hits[0] and not self.enable_caching:
            raise ValueError("prefix-cache hits passed while caching is disabled")
        return hits
