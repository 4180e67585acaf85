"""KVCacheBlock, FreeKVCacheBlockQueue and BlockPool: ordering, ref counts, the prefix-cache index."""

from __future__ import annotations

import pytest

from pagedllm.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


# -- FreeKVCacheBlockQueue ---------------------------------------------------------------------------------------


def test_queue_keeps_insertion_order_and_counts() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    assert _ids(q.popleft_n(2)) == [1, 2]
    assert q.num_free_blocks == 2
    q.append(blocks[0])
    q.appendleft(blocks[1])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    q.append_n([blocks[2]])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    assert q.num_free_blocks == 5


def test_queue_remove_from_middle_relinks_only_the_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    # O(1): the removed block's neighbours now point at each other; nothing else is walked or rewritten.
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert _ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert _ids(q.get_all_free_blocks()) == [1, 3]
    assert q.num_free_blocks == 2
    q.append(blocks[2])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 2]


def test_queue_remove_is_constant_time_on_a_large_queue() -> None:
    # 50k blocks, 5k removals from the middle: a linear-time remove would take ~10^8 steps here.
    blocks = [KVCacheBlock(i) for i in range(50_000)]
    q = FreeKVCacheBlockQueue(blocks)
    for b in blocks[20_000:25_000]:
        q.remove(b)
    assert q.num_free_blocks == 45_000
    assert blocks[19_999].next_free is blocks[25_000]


def test_queue_errors() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert q.num_free_blocks == 2  # a failed popleft_n takes nothing
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    q.append(blocks[0])
    with pytest.raises(AssertionError):
        q.append(blocks[0])  # linking a block twice would corrupt the list


# -- BlockPool ----------------------------------------------------------------------------------------------------


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert sorted(_ids(got)) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    # Freeing or touching the null block is a no-op: its ref count is not maintained.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 0 and pool.null_block.ref_cnt == 0


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_usage_counts_non_null_blocks() -> None:
    pool = BlockPool(5, enable_caching=False)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


def test_ref_counting_touch_and_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [_h(1)], 0, 1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    # Still cached while free: a hit touches it back out of the free queue.
    assert pool.get_cached_block(_h(1)) is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert b not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([b])
    with pytest.raises(AssertionError):
        pool.free_blocks([b])  # freed more often than taken


def test_cached_blocks_are_evicted_in_lru_order() -> None:
    pool = BlockPool(7, enable_caching=True)
    a = pool.get_new_blocks(3)  # request A: hashes 10, 11, 12
    b = pool.get_new_blocks(3)  # request B: hashes 20, 21, 22
    pool.cache_full_blocks(a, [_h(10), _h(11), _h(12)], 0, 3)
    pool.cache_full_blocks(b, [_h(20), _h(21), _h(22)], 0, 3)
    # A finishes first, then B; each frees tail first.
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == _ids(a[::-1] + b[::-1])

    # Allocation evicts from the head: A's tail block first, A's head block survives longest of A's.
    (n1,) = pool.get_new_blocks(1)
    assert n1 is a[2] and n1.block_hash is None and pool.get_cached_block(_h(12)) is None
    assert pool.get_cached_block(_h(10)) is a[0]
    n2 = pool.get_new_blocks(2)
    assert n2 == [a[1], a[0]]
    assert pool.get_cached_block(_h(10)) is None and pool.get_cached_block(_h(20)) is b[0]
    assert pool.counters.blocks_evicted == 3


def test_hit_moves_block_out_of_eviction_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [_h(1), _h(2), _h(3)], 0, 3)
    pool.free_blocks(blocks)  # eviction order 1, 2, 3
    hit = pool.get_cached_block(_h(1))
    assert hit is blocks[0]
    pool.touch([hit])
    pool.free_blocks([hit])  # used again: now the most recently used
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == _ids([blocks[1], blocks[2], blocks[0]])


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(5, enable_caching=True)
    cached = pool.get_new_blocks(2)
    pool.cache_full_blocks(cached, [_h(1), _h(2)], 0, 2)
    partial = pool.get_new_blocks(1)  # a partly filled last block: never hashed
    pool.free_blocks(reversed(cached + partial))
    # The worthless block goes to the head, the cached ones keep their LRU place.
    assert pool.get_new_blocks(1) == partial
    assert pool.get_cached_block(_h(1)) is cached[0] and pool.get_cached_block(_h(2)) is cached[1]


def test_duplicate_hashes_are_kept_and_evicted_one_by_one() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [_h(7)], 0, 1)
    pool.cache_full_blocks([second], [_h(7)], 0, 1)  # same content computed twice: no de-dup
    assert set(pool.cached_block_hash_to_block[(0, _h(7))]) == {first.block_id, second.block_id}
    pool.free_blocks([first, second])
    pool.get_new_blocks(2)  # uncached block 3 first, then `first` (LRU among cached)
    assert pool.get_cached_block(_h(7)) is second


def test_hashes_are_per_group() -> None:
    pool = BlockPool(4, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b0], [_h(5)], 0, 1, group_id=0)
    pool.cache_full_blocks([b1], [_h(5)], 0, 1, group_id=1)
    assert pool.get_cached_block(_h(5), 0) is b0
    assert pool.get_cached_block(_h(5), 1) is b1
    assert pool.get_cached_block(_h(5), 2) is None


def test_cache_full_blocks_registers_only_the_new_range_and_never_rehashes() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [_h(1), _h(2), _h(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 1)
    assert [b.block_hash for b in blocks] == [_h(1), None, None]
    pool.cache_full_blocks(blocks, hashes, 1, 3)
    assert [b.block_hash for b in blocks] == hashes
    assert pool.counters.blocks_cached == 3
    with pytest.raises(AssertionError):
        pool.cache_full_blocks(blocks, hashes, 2, 3)  # a block's hash is set once
    # Null blocks (dropped sliding-window slots) are skipped.
    pool.cache_full_blocks([pool.null_block], [_h(9)], 0, 1)
    assert pool.null_block.block_hash is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_h(1), _h(2)], 0, 2)
    assert pool.get_cached_block(_h(1)) is None
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_h(1), _h(2)], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_h(1)) is blocks[0]  # nothing dropped
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(_h(1)) is None and pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 3
    assert pool.counters.prefix_cache_resets == 1
