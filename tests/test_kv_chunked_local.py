"""The `chunked_local` KV manager (Llama 4's chunked local attention): blocks wholly before the current chunk go
back to the pool while the request runs and count as free, the bound the spec gives capacity planning holds,
a prefix hit holds exactly the blocks its resumed chunk reads (chunk edges on and inside blocks), usage is back
to 0 at the end -- and the conformance kit's random workload (preemption, eviction, hits) keeps the books."""

from __future__ import annotations

import pytest
import torch

from pagedllm.api import ChunkedLocalAttentionSpec, SlidingWindowSpec
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.plugins.kvmanagers.chunked_local.manager import ChunkedLocalManager
from pagedllm.testing import check_kv_manager

BLOCK, CHUNK = 4, 8


def _spec(chunk: int = CHUNK) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(BLOCK, 1, 8, torch.float32, attention_chunk_size=chunk)


def _hashes(num_blocks: int) -> list[bytes]:
    return [f"block{i}".encode() for i in range(num_blocks)]


def _needed(position: int, chunk: int) -> range:
    """The blocks a token at `position` reads: from its chunk's first position's block up to its own."""
    return range(position // chunk * chunk // BLOCK, -(-(position + 1) // BLOCK))


@pytest.mark.parametrize("chunk", [CHUNK, 6])  # chunk edges on block edges, and inside blocks
def test_earlier_chunks_go_back_to_the_pool_mid_request(chunk: int) -> None:
    pool = BlockPool(64, enable_caching=False)
    manager = ChunkedLocalManager(_spec(chunk), pool, 0)
    prompt = 5
    manager.allocate_new_blocks("r", prompt)
    released_at = []
    for computed in range(prompt, 60):  # decode one token a step as the scheduler does: release, then allocate
        free_before = pool.get_num_free_blocks()
        manager.remove_skipped_blocks("r", computed)
        if pool.get_num_free_blocks() > free_before:
            released_at.append(computed)
        manager.allocate_new_blocks("r", computed + 1)
        blocks = manager.get_blocks("r")
        needed = _needed(computed, chunk)
        # Everything the token at `computed` reads is held; everything wholly before its chunk is released.
        assert all(not blocks[i].is_null for i in needed)
        assert all(b.is_null for b in blocks[: needed.start])
        real = [b for b in blocks if not b.is_null]
        assert len(real) <= _spec(chunk).max_blocks_per_request(computed + 1, 1)
        assert pool.get_num_free_blocks() == pool.num_blocks - 1 - len(real)  # released blocks count as free
    # Blocks come back when a chunk's start passes a block edge: every chunk once, for chunk 8 at its start.
    if chunk == CHUNK:
        assert released_at == list(range(CHUNK, 60, CHUNK))
    else:
        assert released_at and all(c // chunk * chunk // BLOCK > (c - 1) // chunk * chunk // BLOCK for c in released_at)
    manager.free("r")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and pool.get_usage() == 0.0
    assert not manager.req_to_blocks


def test_short_requests_hold_no_more_than_their_length() -> None:
    pool = BlockPool(16, enable_caching=False)
    manager = ChunkedLocalManager(_spec(), pool, 0)
    manager.allocate_new_blocks("r", 7)
    manager.remove_skipped_blocks("r", 7)  # still in the first chunk: nothing to release
    assert len(manager.get_blocks("r")) == 2 == _spec().max_blocks_per_request(7, 7)
    manager.free("r")
    assert pool.get_usage() == 0.0


def _cached_pool(chunk: int, num_blocks: int, hole: int | None = None) -> tuple[ChunkedLocalManager, list[bytes]]:
    """A manager whose pool holds a finished request's `num_blocks` full blocks, cached (block `hole` not)."""
    pool = BlockPool(64, enable_caching=True)
    manager = ChunkedLocalManager(_spec(chunk), pool, 0)
    hashes = _hashes(num_blocks)
    manager.allocate_new_blocks("a", num_blocks * BLOCK)
    cached = [b"other" if i == hole else h for i, h in enumerate(hashes)]
    manager.cache_blocks("a", cached, num_blocks * BLOCK)
    manager.free("a")
    return manager, hashes


def _check_hit(hit: list, chunk: int) -> None:
    """The resumed token (position len(hit) * BLOCK) reads only real blocks; earlier ones are null."""
    if not hit:
        return
    start = len(hit) * BLOCK // chunk * chunk // BLOCK
    assert all(b.is_null for b in hit[:start]) and all(not b.is_null for b in hit[start:])


def test_prefix_hits_hold_only_the_resumed_chunk() -> None:
    manager, hashes = _cached_pool(CHUNK, 10)
    # Asked for 39 tokens (9 blocks): the hit resumes at 36, in the chunk 32..39: block 8 real, 0..7 null.
    hit = manager.find_longest_cache_hit(hashes, 39)
    assert len(hit) == 9 and [b.is_null for b in hit] == [True] * 8 + [False]
    # Resuming exactly at a chunk's start reads nothing before it (vLLM's example 2): a hit of nulls only.
    hit = manager.find_longest_cache_hit(hashes, 40)
    assert len(hit) == 10 and all(b.is_null for b in hit)
    # A hole in the chunk the hit would resume in ends the hit at the hole: asked for 31 tokens (resuming at
    # 28, chunk 24..31) with block 6 (24..27) not cached, the hit resumes at 24, the chunk's start.
    manager, hashes = _cached_pool(CHUNK, 10, hole=6)
    hit = manager.find_longest_cache_hit(hashes, 31)
    assert len(hit) == 6 and all(b.is_null for b in hit)
    # ... a hole before the resumed chunk costs nothing: a token at 36 never reads block 6.
    hit = manager.find_longest_cache_hit(hashes, 39)
    assert len(hit) == 9
    _check_hit(hit, CHUNK)


def test_a_chunk_edge_inside_a_block_looks_up_the_previous_chunk() -> None:
    chunk = 6  # chunks 0..5, 6..11, 12..17, 18..23: block 4 (16..19) holds the tail of one and the head of the next
    manager, hashes = _cached_pool(chunk, 6, hole=4)
    # Asked for 20 tokens: the chunk of 20 starts at 18 (block 4), not cached, so the hit would end at 16 --
    # inside the chunk 12..17, which reads block 3 (12..15): the look-up is repeated there.
    hit = manager.find_longest_cache_hit(hashes, 20)
    assert len(hit) == 4 and not hit[3].is_null and all(b.is_null for b in hit[:3])
    _check_hit(hit, chunk)
    for max_length in range(0, 24):  # every length: the hit is sound and as long as the cache allows
        _check_hit(manager.find_longest_cache_hit(hashes, max_length), chunk)


def test_the_engine_gives_chunked_specs_to_the_chunked_local_manager() -> None:
    from pagedllm.engine.kv_plan import select_kv_manager
    from pagedllm.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    assert select_kv_manager(pm, _spec()).winner.name == "chunked_local"
    window = SlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=CHUNK)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        ChunkedLocalManager(window, BlockPool(8, enable_caching=False), 0)


def test_conformance_kit_random_workload() -> None:
    # The kit's default spec (a chunk of 1.5 blocks) over a pool small enough that allocations fail.
    report = check_kv_manager("chunked_local", num_blocks=7)
    assert report.admissions > 50 and report.preemptions > 10
    assert report.hit_blocks > 0 and report.allocation_failures > 0
