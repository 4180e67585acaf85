"""The engine dashboard's data, recorded in the engine core only while watched (engine/engine_watch.py,
kv_cache/pool_snapshot.py): checked against the block pool's own counts and the engine's RequestOutputs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pagedllm.engine.engine_watch import EngineSnapshot
from pagedllm.engine.serialization import Outputs, Watch, decode_from_core, decode_to_core, encode
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.pool_snapshot import CACHED, FREE, IN_USE, SHARED, snapshot_pool


def test_pool_snapshot_counts_each_state() -> None:
    pool = BlockPool(13, enable_caching=True)  # 12 usable blocks (block 0 is the null block)
    held = pool.get_new_blocks(6)  # blocks 1..6, ref 1
    pool.touch(held[:2])  # 1, 2 shared by a second request
    pool.cache_full_blocks(held, [bytes([i]) * 8 for i in range(6)], 0, 4)  # 1..4 registered
    pool.free_blocks([held[3], held[2]])  # 3, 4: free but cached (evictable)
    snap = snapshot_pool(pool, block_size=16)
    expected = [SHARED, SHARED, CACHED, CACHED, IN_USE, IN_USE] + [FREE] * 6
    assert snap.cells == expected and snap.blocks_per_cell == 1
    assert (snap.free, snap.cached, snap.in_use, snap.shared) == (6, 2, 2, 2)
    assert snap.free + snap.cached == pool.get_num_free_blocks()  # the pool's own count of free blocks
    assert snap.num_blocks == 12 and snap.block_size == 16
    # Drawn smaller: 12 blocks in 4 cells of 3, each the state most of its blocks are in.
    small = snapshot_pool(pool, block_size=16, max_cells=4)
    assert small.blocks_per_cell == 3 and small.cells == [SHARED, IN_USE, FREE, FREE]
    assert (small.free, small.cached, small.in_use, small.shared) == (6, 2, 2, 2)  # counts are never sampled


def test_watch_messages_round_trip() -> None:
    assert decode_to_core(encode(Watch(0.5))) == Watch(0.5)
    snap = EngineSnapshot(time=1.0, window_s=0.5, num_running=1, num_waiting=2, num_preempted=1,
                          kv=snapshot_pool(BlockPool(4, True), 4), num_steps=3, busy_s=0.1, prefill_tokens=10,
                          decode_tokens=2, generated_tokens=3)
    back = decode_from_core(encode(Outputs([], None, 2.0, snap)))
    assert isinstance(back, Outputs) and back.snapshot == snap
    with pytest.raises(msgspec.ValidationError):  # typed: a malformed snapshot is rejected, never guessed at
        decode_from_core(msgspec.msgpack.encode({"type": "outputs", "outputs": [], "snapshot": {"time": "x"}}))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "pipelined"])
def test_engine_records_only_while_watched(tmp_path: Path, async_scheduling: bool) -> None:
    from tiny_models import make_tiny_model

    from pagedllm import LLM, SamplingParams

    llm = LLM(make_tiny_model("llama", tmp_path), block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
              async_scheduling=async_scheduling)
    assert llm.engine.core.async_scheduling is async_scheduling
    core = llm.engine.core
    assert core.watch is None and core.snapshot() is None  # nobody watches: nothing is recorded
    core.set_watching(True)
    steps_before = core.get_stats().num_steps
    shared = list(range(3, 23))  # 20 tokens: five full blocks the later prompts find in the prefix cache
    prompts = [{"prompt_token_ids": shared + [30 + i] * (i + 1)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    outputs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    snap = core.snapshot()
    assert snap is not None
    # Pipelined, each generate()'s last schedule() only collects the step in flight: it launches no step.
    empty = 2 if async_scheduling else 0
    assert snap.num_steps == core.get_stats().num_steps - steps_before - empty == len(snap.steps)
    # Each request computes its prompt less its prefix-cache hit, then one decode token per output but the last.
    assert snap.prefill_tokens == sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)
    assert sum(o.num_cached_tokens for o in outputs) >= 2 * 20  # the later two hit the shared blocks
    assert snap.decode_tokens == sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    assert snap.generated_tokens == sum(len(o.outputs[0].token_ids) for o in outputs) == 3 * 7
    assert sum(s.prefill_tokens + s.decode_tokens for s in snap.steps) == snap.prefill_tokens + snap.decode_tokens
    assert snap.num_running == snap.num_waiting == 0 and snap.kv is not None
    assert snap.kv.in_use == snap.kv.shared == 0 and snap.kv.cached > 0  # all freed; the prefixes stay cached
    timelines = {t.request_id: t for t in snap.requests}
    assert len(timelines) == 3
    for out in outputs:
        t = timelines[out.request_id]
        assert t.finish_reason == "length" and t.state == "finished" and t.output_tokens == 7
        assert t.scheduled is not None and t.first_token is not None and t.finished is not None
        assert t.arrival <= t.scheduled <= t.first_token <= t.finished
        assert t.cached_tokens == out.num_cached_tokens
    again = core.snapshot()  # a new window: nothing ran since
    assert again is not None and again.num_steps == 0 and again.steps == []
    core.set_watching(False)
    assert core.watch is None and core.snapshot() is None
    llm.engine.shutdown()


def test_preemptions_are_counted_and_timed(tmp_path: Path) -> None:
    """Under KV pressure (the setting of test_continuous_batching's preemption test) the snapshots count the
    preempted requests while they wait, and their timelines say when they were preempted and resumed."""
    import random

    from tiny_models import make_tiny_model

    from pagedllm import LLM, SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    llm = LLM(make_tiny_model("llama", tmp_path), block_size=4, num_kv_blocks=40, max_num_seqs=8,
              enable_prefix_caching=False, admission_headroom_tokens=0)
    engine, core = llm.engine, llm.engine.core
    core.set_watching(True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    most_preempted, timelines = 0, {}
    while engine.has_unfinished_requests():
        engine.step()
        snap = core.snapshot()
        assert snap is not None and snap.kv is not None
        most_preempted = max(most_preempted, snap.num_preempted)
        timelines.update({t.request_id: t for t in snap.requests})
        # The snapshot's queue counts are the scheduler's own.
        assert (snap.num_running, snap.num_waiting) == (len(core.scheduler.running), len(core.scheduler.waiting))
    assert engine.get_stats().num_preemptions > 0 and most_preempted > 0
    preempted = [t for t in timelines.values() if t.preemptions]
    assert preempted and len(timelines) == len(prompts)
    for t in preempted:
        assert t.preempted is not None and t.resumed is not None and t.finished is not None
        assert t.arrival <= t.scheduled <= t.preempted <= t.resumed <= t.finished  # type: ignore[operator]
    assert sum(t.preemptions for t in timelines.values()) == engine.get_stats().num_preemptions
    engine.shutdown()
