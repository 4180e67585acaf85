"""KVCacheManager over FullAttentionManager: hashing, prefix hits, all-or-nothing allocation, stats, and a
stateful property test that drives it like a scheduler would (admit, chunked prefill, decode, preempt, free)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.hashing import hash_block_tokens, update_block_hashes
from pagedllm.kv_cache.kv_cache_manager import (
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheManager,
    PrefixCacheStats,
)
from pagedllm.kv_cache.single_type_manager import cdiv
from pagedllm.kv_cache.spec import FullAttentionSpec, KVCacheSpec
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def _spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)


def make_manager(
    num_blocks: int = 16, block_size: int = 4, enable_caching: bool = True, max_model_len: int = 1024
) -> KVCacheManager:
    config = KVCacheConfig(num_blocks, [KVCacheGroup(_spec(block_size), [0])])
    return KVCacheManager(config, [FullAttentionManager], enable_caching, max_model_len=max_model_len)


def make_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> tuple[KVCacheBlocks | None, int]:
    """What a scheduler does for a waiting request: look up hits, allocate, advance num_computed_tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(req, num_new, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + num_new
    return new, num_hit


def decode(kv: KVCacheManager, req: Request, token: int) -> KVCacheBlocks | None:
    """One decode step: the sampled token is appended, then a slot is allocated for it."""
    assert req.num_computed_tokens == req.num_tokens
    req.output_token_ids.append(token)
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def snapshot(kv: KVCacheManager, req: Request) -> Any:
    """Everything allocate_slots could change, as plain values."""
    pool = kv.block_pool
    managers: list[Any] = kv.coordinator.managers
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {k: sorted(v) for k, v in pool.cached_block_hash_to_block.items()},
        [{rid: [b.block_id for b in bl] for rid, bl in m.req_to_blocks.items()} for m in managers],
        [dict(m.num_cached_block) for m in managers],
        list(req.block_hashes),
        req.num_computed_tokens,
        list(req.output_token_ids),
    )


# -- hashing ---------------------------------------------------------------------------------------------------


def test_block_hash_is_stable_across_processes_and_versions() -> None:
    # Golden values: a change here silently invalidates every persisted or shared prefix cache.
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first.hex() == "3e5be1346b51039dbd4eeaa5c6446f8e9f860a6d6feb110d9b8d0d244482f0a8"
    second = hash_block_tokens(first, [5, 6, 7, 8], ("salt",))
    assert second.hex() == "bbfdade8686f5a39213ff47892ea874935fc6a1c284aff4f7497118814aeae49"


def test_block_hash_separates_parents_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == base
    assert hash_block_tokens(base, [1, 2]) != base
    assert hash_block_tokens(None, [2, 1]) != base
    assert hash_block_tokens(None, [1, 2], ()) != base
    distinct = {
        hash_block_tokens(None, [1, 2], keys)
        for keys in [("ab",), ("a", "b"), (1,), ("1",), (b"1",), (True,), (None,), ((1,),), (-1,), (2**70,)]
    }
    assert len(distinct) == 10
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))


def test_update_block_hashes_hashes_full_blocks_incrementally() -> None:
    req = make_request("a", list(range(10)))
    update_block_hashes(req, 4)
    assert len(req.block_hashes) == 2
    req.output_token_ids.extend([10, 11])
    update_block_hashes(req, 4)
    assert len(req.block_hashes) == 3
    # The same as hashing the final token list in one go, chained block by block.
    expected: list[bytes] = []
    parent = None
    for i in range(3):
        parent = hash_block_tokens(parent, list(range(i * 4, i * 4 + 4)), None)
        expected.append(parent)
    assert req.block_hashes == expected


def test_cache_salt_changes_every_block_hash() -> None:
    plain, salted, salted_too = (
        make_request(r, list(range(12)), s) for r, s in [("a", None), ("b", "x"), ("c", "x")]
    )
    for req in (plain, salted, salted_too):
        update_block_hashes(req, 4)
    assert salted.block_hashes == salted_too.block_hashes
    assert all(p != s for p, s in zip(plain.block_hashes, salted.block_hashes, strict=True))


# -- prefix caching -------------------------------------------------------------------------------------------------


def test_prefix_hit_shares_blocks() -> None:
    kv = make_manager()
    a = make_request("a", list(range(10)))
    new_a, hit_a = admit(kv, a)
    assert hit_a == 0 and new_a is not None and len(new_a.blocks[0]) == 3
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert hits.get_block_ids() == [kv.get_block_ids("a")[0][:2]]
    new_b = kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    assert new_b is not None and len(new_b.blocks[0]) == 1  # hits are not "newly allocated"
    assert kv.get_block_ids("b")[0][:2] == kv.get_block_ids("a")[0][:2]
    assert [blk.ref_cnt for blk in kv.get_blocks("b").blocks[0]] == [2, 2, 1]


def test_hit_is_capped_to_recompute_the_last_token() -> None:
    kv = make_manager()
    prompt = list(range(8))  # exactly two full blocks
    admit(kv, make_request("a", prompt))
    _, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 4  # not 8: the last prompt token's logits are needed
    _, num_hit = kv.get_computed_blocks(make_request("c", prompt + [5]))
    assert num_hit == 8
    _, num_hit = kv.get_computed_blocks(make_request("d", [0]))
    assert num_hit == 0


def test_cache_salt_separates_prefixes() -> None:
    kv = make_manager()
    prompt = list(range(9))
    admit(kv, make_request("a", prompt, salt="tenant-1"))
    assert kv.get_computed_blocks(make_request("b", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, salt="tenant-1"))[1] == 8


def test_decoded_tokens_fill_blocks_that_are_then_cached() -> None:
    kv = make_manager()
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    assert [blk.block_hash is not None for blk in kv.get_blocks("a").blocks[0]] == [True, False]
    assert decode(kv, a, 7) is not None  # 7 tokens: block 2 not full yet
    new = decode(kv, a, 8)
    assert new is not None and new.blocks[0] == []  # the 8th slot is in the existing block
    assert [blk.block_hash is not None for blk in kv.get_blocks("a").blocks[0]] == [True, True]
    new = decode(kv, a, 9)
    assert new is not None and len(new.blocks[0]) == 1
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 8


def test_preempted_request_hits_its_own_blocks() -> None:
    kv = make_manager()
    a = make_request("a", list(range(9)))
    admit(kv, a)
    for t in (100, 101, 102):
        decode(kv, a, t)
    prefix_ids = kv.get_block_ids("a")[0][:3]
    kv.free(a)  # preempt: recompute later
    a.num_computed_tokens = 0
    new, num_hit = admit(kv, a)
    assert num_hit == 8  # 12 tokens known: 3 full blocks, capped at 11 tokens -> 2 blocks
    assert new is not None and kv.get_block_ids("a")[0][:2] == prefix_ids[:2]


def test_freed_request_is_evicted_tail_first() -> None:
    kv = make_manager(num_blocks=5)  # 4 usable blocks
    a = make_request("a", list(range(12)) + [0])  # 4 blocks, 3 cached
    admit(kv, a)
    kv.free(a)
    assert kv.usage == 0.0 and kv.num_free_blocks == 4
    # A new request needing one block takes the uncached partial block first, then A's tail.
    admit(kv, make_request("b", [50]))
    assert kv.get_computed_blocks(make_request("c", list(range(12)) + [1]))[1] == 12
    admit(kv, make_request("d", [60, 61, 62, 63, 64]))  # two blocks: A's block 2, then block 1
    assert kv.get_computed_blocks(make_request("e", list(range(12)) + [1]))[1] == 4


def test_allocate_slots_counts_evictable_hits_and_changes_nothing_on_failure() -> None:
    kv = make_manager(num_blocks=5)  # 4 usable blocks
    a = make_request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)  # 3 cached blocks, free (ref 0)
    b = make_request("b", list(range(12)) + list(range(100, 108)))  # 20 tokens = 5 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12 and all(blk.ref_cnt == 0 for blk in hits.blocks[0])
    # 2 new blocks would fit the 4 free ones, but touching the 3 hits takes them out of the free pool.
    before = snapshot(kv, b)
    assert kv.allocate_slots(b, 8, num_hit, hits) is None
    assert snapshot(kv, b) == before
    # 4 blocks in all (3 hits + 1 new) fit exactly.
    new = kv.allocate_slots(b, 4, num_hit, hits)
    assert new is not None and len(new.blocks[0]) == 1
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_running_request_out_of_blocks_changes_nothing() -> None:
    kv = make_manager(num_blocks=3)  # 2 usable
    a = make_request("a", list(range(8)))
    admit(kv, a)
    before = snapshot(kv, a)
    assert decode(kv, a, 9) is None
    a.output_token_ids.pop()  # undo the test's own append; the manager touched nothing
    assert snapshot(kv, a) == before


def test_prefix_cache_stats_count_each_lookup_and_reset() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(10))))
    admit(kv, make_request("b", list(range(10))))
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert kv.make_prefix_cache_stats() == PrefixCacheStats()


def test_caching_disabled() -> None:
    kv = make_manager(enable_caching=False)
    admit(kv, make_request("a", list(range(10))))
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(10))))
    assert num_hit == 0 and hits.get_block_ids() == [[]]
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.make_prefix_cache_stats().queries == 0


def test_max_model_len_caps_the_slots() -> None:
    kv = make_manager(max_model_len=10)
    a = make_request("a", list(range(8)))
    new = kv.allocate_slots(a, 8 + 16)  # e.g. lookahead past the limit
    assert new is not None and len(new.blocks[0]) == 3


def test_reset_prefix_cache() -> None:
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(10))))[1] == 8
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("c", list(range(10))))[1] == 0


def test_hits_must_match_their_token_count() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)))
    hits, num_hit = kv.get_computed_blocks(b)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 2, num_hit - 4, hits)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 2, num_hit)


def test_kv_cache_blocks_value() -> None:
    pool = BlockPool(6, enable_caching=False)
    b1, b2, b3 = pool.get_new_blocks(3)
    x = KVCacheBlocks(([b1], [b2]))
    y = KVCacheBlocks(([b3], []))
    assert (x + y).get_block_ids() == [[b1.block_id, b3.block_id], [b2.block_id]]
    assert (x + KVCacheBlocks()).get_block_ids() == x.get_block_ids()
    assert (KVCacheBlocks() + x) is x
    assert KVCacheBlocks.empty(2).get_block_ids() == [[], []]
    assert (x + y).num_blocks() == 3
    with pytest.raises(ValueError):
        _ = x + KVCacheBlocks.empty(3)


# -- the coordinator with several groups ----------------------------------------------------------------------------


def _hybrid(num_blocks: int, factories: list[Any], sizes: list[int]) -> KVCacheManager:
    groups = [KVCacheGroup(_spec(bs), [i]) for i, bs in enumerate(sizes)]
    return KVCacheManager(KVCacheConfig(num_blocks, groups), factories, max_model_len=1024)


def test_hybrid_groups_agree_on_a_common_hit_length() -> None:
    kv = _hybrid(32, [FullAttentionManager, FullAttentionManager], [2, 4])
    assert kv.block_size == 2
    a = make_request("a", list(range(11)))
    new, _ = admit(kv, a)
    assert new is not None and [len(g) for g in new.blocks] == [6, 3]
    b = make_request("b", list(range(11)))
    hits, num_hit = kv.get_computed_blocks(b)
    # Group 0 (2 tokens/block) could reuse 10 tokens, group 1 (4/block) only 8: both take 8.
    assert num_hit == 8
    assert [len(g) for g in hits.blocks] == [4, 2]
    assert hits.get_block_ids() == [
        ids[: len(g)] for ids, g in zip(kv.get_block_ids("a"), hits.blocks, strict=True)
    ]
    assert kv.allocate_slots(b, 3, num_hit, hits) is not None
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0


def test_hybrid_block_sizes_must_be_multiples() -> None:
    with pytest.raises(ValueError):
        _hybrid(8, [FullAttentionManager, FullAttentionManager], [4, 6])
    with pytest.raises(ValueError):
        _hybrid(8, [FullAttentionManager], [4, 4])


class _ChunkedHitManager(FullAttentionManager):
    """A layer type that can only resume at multiples of 12 tokens, and records what it was asked."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.asked: list[int] = []

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        self.asked.append(max_length)
        hits = super().find_longest_cache_hit(block_hashes, max_length)
        return hits[: len(hits) * self.block_size // 12 * 12 // self.block_size]


def test_hybrid_hit_is_a_fixed_point_over_groups() -> None:
    kv = _hybrid(32, [FullAttentionManager, _ChunkedHitManager], [4, 4])
    admit(kv, make_request("a", list(range(30))))
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(30))))
    assert num_hit == 24
    assert [len(g) for g in hits.blocks] == [6, 6]
    chunked: Any = kv.coordinator.managers[1]
    assert chunked.asked == [28, 24]  # asked again at the lowered length, which then held


# -- stateful property test -----------------------------------------------------------------------------------------

ALPHABET = st.integers(0, 2)  # a tiny alphabet so prompts share prefixes and hashes collide on purpose


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager as a scheduler would and checks the pool's books after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.bs = 0
        self.num_blocks = 0
        self.caching = True
        self.requests: dict[str, Request] = {}
        self.running: set[str] = set()
        self.counter = 0
        # block id -> (hash, salt, every token up to the block's end) when it was registered.
        self.registered: dict[int, tuple[bytes, str | None, tuple[int, ...]]] = {}

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 24),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.bs, self.num_blocks, self.caching = block_size, num_blocks, caching
        self.kv = make_manager(num_blocks, block_size, caching, max_model_len=4096)

    @property
    def waiting(self) -> list[str]:
        return sorted(set(self.requests) - self.running)

    @precondition(lambda self: len(self.requests) < 6)
    @rule(prompt=st.lists(ALPHABET, min_size=1, max_size=14), salt=st.sampled_from([None, None, None, "s"]))
    def add_request(self, prompt: list[int], salt: str | None) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        self.requests[rid] = make_request(rid, prompt, salt)

    @precondition(lambda self: len(self.requests) > len(self.running))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        kv = self._kv()
        req = self.requests[data.draw(st.sampled_from(self.waiting))]
        hits, num_hit = kv.get_computed_blocks(req)
        assert num_hit % self.bs == 0 and num_hit <= req.num_tokens - 1
        if not self.caching:
            assert num_hit == 0
        for i, blk in enumerate(hits.blocks[0]):
            # The heart of prefix caching: a hit block holds exactly this request's tokens up to its end.
            h, salt, tokens = self.registered[blk.block_id]
            assert h == blk.block_hash and salt == req.cache_salt
            assert tokens == tuple(req.all_token_ids[: (i + 1) * self.bs])
        num_new = data.draw(st.integers(1, req.num_tokens - num_hit))
        self._allocate(req, num_new, num_hit, hits)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data: st.DataObject, num_steps: int) -> None:
        """A few scheduler steps for running requests: the next prefill chunk, or one decoded token."""
        for _ in range(num_steps):
            if not self.running:
                return
            req = self.requests[data.draw(st.sampled_from(sorted(self.running)))]
            if req.num_computed_tokens == req.num_tokens:
                if req.num_tokens >= 40:
                    continue
                req.output_token_ids.append(data.draw(ALPHABET))  # the previous step sampled it
            num_new = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
            self._allocate(req, num_new, 0, None)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        """Finish (or abort) a request, or preempt a running one: free it and recompute it later."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        self._kv().free(req)
        self.running.discard(rid)
        if preempt:
            req.num_computed_tokens = 0
        else:
            del self.requests[rid]

    @rule(dice=st.integers(0, 7))
    def reset_prefix_cache(self, dice: int) -> None:
        if dice:  # rare: a reset empties the cache the other rules want to hit
            return
        kv = self._kv()
        ok = kv.reset_prefix_cache()
        assert ok == (not self.running)  # every running request holds at least one block
        if ok:
            assert kv.block_pool.cached_block_hash_to_block == {}
            self.registered.clear()

    def _allocate(self, req: Request, num_new: int, num_hit: int, hits: KVCacheBlocks | None) -> None:
        kv = self._kv()
        before = snapshot(kv, req)
        new = kv.allocate_slots(req, num_new, num_hit, hits)
        if new is None:
            assert snapshot(kv, req) == before
            return
        req.num_computed_tokens = req.num_computed_tokens + num_hit + num_new
        self.running.add(req.request_id)
        tokens = req.all_token_ids
        for i, blk in enumerate(kv.get_blocks(req.request_id).blocks[0]):
            if blk.block_hash is not None and self.registered.get(blk.block_id, (None,))[0] != blk.block_hash:
                assert blk.block_hash == req.block_hashes[i]
                self.registered[blk.block_id] = (
                    blk.block_hash,
                    req.cache_salt,
                    tuple(tokens[: (i + 1) * self.bs]),
                )

    def _kv(self) -> KVCacheManager:
        assert self.kv is not None
        return self.kv

    @invariant()
    def books_balance(self) -> None:
        if self.kv is None:
            return
        kv, pool = self.kv, self.kv.block_pool
        holders: Counter[int] = Counter()
        for rid, req in self.requests.items():
            ids = kv.get_block_ids(rid)[0]
            if rid not in self.running:
                assert ids == []
                continue
            assert len(ids) == len(set(ids)), "a request holds a block twice"
            assert len(ids) == cdiv(req.num_computed_tokens, self.bs)
            holders.update(ids)
            manager: Any = kv.coordinator.managers[0]
            for i, blk in enumerate(kv.get_blocks(rid).blocks[0][: manager.num_cached_block[rid]]):
                assert blk.block_hash == req.block_hashes[i]
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert 0 not in free and 0 not in holders
        free_set = set(free)
        for blk in pool.blocks[1:]:
            held = holders[blk.block_id]
            if held:
                assert blk.ref_cnt == held and blk.block_id not in free_set
            else:
                assert blk.ref_cnt == 0 and blk.block_id in free_set
        hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
        indexed: set[int] = set()
        for (gid, h), entries in pool.cached_block_hash_to_block.items():
            assert entries
            for bid, blk in entries.items():
                assert blk.block_id == bid and blk.block_hash == h and blk.group_id == gid
                indexed.add(bid)
        assert hashed == indexed
        assert hashed <= set(self.registered)
        if not self.caching:
            assert not hashed
        assert kv.usage == pytest.approx(len(holders) / (self.num_blocks - 1))

    def teardown(self) -> None:
        if self.kv is None:
            return
        for req in self.requests.values():
            self.kv.free(req)
        assert self.kv.usage == 0.0
        assert self.kv.num_free_blocks == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
TestKVCacheManagerStateMachine = KVCacheMachine.TestCase
