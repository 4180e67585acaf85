"""The `sink` KV manager (StreamingLLM sinks: a sliding window plus the first num_sink_tokens tokens): the
sink blocks are never freed while a request runs, the window's past goes back to the pool, the bound the spec
gives capacity planning holds, prefix hits need the sink blocks, usage is back to 0 at the end -- and the
conformance kit's random workload (preemption, eviction, hits) keeps the pool's books."""

from __future__ import annotations

import pytest
import torch

from pagedllm.api import SinkSlidingWindowSpec, SlidingWindowSpec
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.plugins.kvmanagers.sink.manager import SinkWindowManager
from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager
from pagedllm.testing import check_kv_manager

BLOCK, WINDOW, SINK_TOKENS = 4, 8, 6  # sinks fill 1.5 blocks: 2 sink blocks
SINK_BLOCKS = 2
SPEC = SinkSlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=WINDOW, num_sink_tokens=SINK_TOKENS)


def _hashes(tokens: int, salt: bytes = b"") -> list[bytes]:
    return [salt + f"block{i}".encode() for i in range(tokens // BLOCK)]


def _run(manager: SinkWindowManager | SlidingWindowManager, rid: str, prompt: int, decode: int) -> list[int]:
    """Prefill `prompt` tokens, then decode one token a step as the scheduler does (release, then allocate);
    returns the real (non-null) blocks held after each step, and checks the sink blocks on the way."""
    pool = manager.block_pool
    manager.allocate_new_blocks(rid, prompt)
    sinks = list(manager.get_blocks(rid)[:SINK_BLOCKS])
    held = []
    for computed in range(prompt, prompt + decode):
        manager.remove_skipped_blocks(rid, computed)
        manager.allocate_new_blocks(rid, computed + 1)
        blocks = manager.get_blocks(rid)
        real = [b for b in blocks if not b.is_null]
        held.append(len(real))
        assert len(real) <= SPEC.max_blocks_per_request(computed + 1, 1)
        # The released region is exactly the window's past, never a sink block.
        first_useful = max(computed - WINDOW + 1, 0) // BLOCK
        if isinstance(manager, SinkWindowManager):
            assert blocks[:SINK_BLOCKS] == sinks and all(b.ref_cnt == 1 for b in sinks)
            assert all(b.is_null for b in blocks[SINK_BLOCKS:first_useful])
        assert all(not b.is_null for b in blocks[first_useful:])
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    assert not free_ids & {b.block_id for b in sinks if isinstance(manager, SinkWindowManager)}
    return held


def test_sink_blocks_stay_pinned_and_the_window_is_released() -> None:
    pool = BlockPool(64, enable_caching=False)
    manager = SinkWindowManager(SPEC, pool, 0)
    held = _run(manager, "r", prompt=10, decode=60)
    # Past the window: the 2 sink blocks plus the window's ceil(8 / 4) + 1 at most, however long it runs.
    assert max(held[30:]) == SINK_BLOCKS + WINDOW // BLOCK + 1
    # Against the plain sliding window on the same run: exactly the sink blocks more, once both are bounded.
    window_only = SlidingWindowManager(SlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=WINDOW),
                                       BlockPool(64, enable_caching=False), 0)
    assert [a - b for a, b in zip(held[30:], _run(window_only, "w", 10, 60)[30:], strict=True)] == [SINK_BLOCKS] * 30
    manager.free("r")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and pool.get_usage() == 0.0
    assert not manager.req_to_blocks


def test_short_requests_hold_no_more_than_their_length() -> None:
    pool = BlockPool(16, enable_caching=False)
    manager = SinkWindowManager(SPEC, pool, 0)
    manager.allocate_new_blocks("r", 5)
    manager.remove_skipped_blocks("r", 5)  # nothing is behind the window yet
    assert len(manager.get_blocks("r")) == 2 == SPEC.max_blocks_per_request(5, 5)
    manager.free("r")
    assert pool.get_usage() == 0.0


def test_a_prefix_hit_needs_the_sink_blocks_and_the_window() -> None:
    pool = BlockPool(64, enable_caching=True)
    manager = SinkWindowManager(SPEC, pool, 0)
    tokens = 40  # 10 full blocks
    hashes = _hashes(tokens)
    manager.allocate_new_blocks("a", tokens)
    manager.cache_blocks("a", hashes, tokens)
    manager.free("a")  # cached blocks stay in the pool, evictable
    hit = manager.find_longest_cache_hit(hashes, tokens)
    assert len(hit) == 10
    need_window = -(-(WINDOW - 1) // BLOCK)  # 2 blocks before the resume point
    assert all(not b.is_null for b in hit[:SINK_BLOCKS] + hit[-need_window:])
    assert all(b.is_null for b in hit[SINK_BLOCKS:-need_window])  # never read again: not held
    # A request whose first block differs shares no sinks: no hit, however much of the rest matches.
    other = [b"other"] + hashes[1:]
    assert manager.find_longest_cache_hit(other, tokens) == []
    # A hole the resumed request would never read (block 7; it reads positions 33..39) costs nothing ...
    assert len(manager.find_longest_cache_hit(hashes[:7] + [b"hole"] + hashes[8:], tokens)) == 10
    # ... one it would read (block 8) cuts the hit back to the longest prefix whose window is whole: 8 blocks.
    shorter = manager.find_longest_cache_hit(hashes[:8] + [b"hole"] + hashes[9:], tokens)
    assert len(shorter) == 8 and not any(b.is_null for b in shorter[:SINK_BLOCKS] + shorter[-need_window:])


def test_the_engine_gives_sink_specs_to_the_sink_manager() -> None:
    from pagedllm.engine.kv_plan import select_kv_manager
    from pagedllm.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    assert select_kv_manager(pm, SPEC).winner.name == "sink"
    plain = SlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=WINDOW)
    assert select_kv_manager(pm, plain).winner.name == "sliding_window"
    with pytest.raises(ValueError, match="SinkSlidingWindowSpec"):
        SinkWindowManager(plain, BlockPool(8, enable_caching=False), 0)


def test_conformance_kit_random_workload() -> None:
    report = check_kv_manager("sink", SPEC)
    assert report.admissions > 50 and report.preemptions > 10
    assert report.hit_blocks > 0 and report.allocation_failures > 0
