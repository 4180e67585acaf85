"""The host-side fast paths of a steady decode step give exactly what the general paths give.

Each fast path (kept block tables, reused sampling params tensors, block ids sent by count, the decode slot
check) is compared against the plain computation on the same inputs, over random sequences of steps that
also change the batch, so a stale row, a missed append or a wrongly reused tensor shows up as a mismatch.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_kv_cache_manager import make_manager, make_request

from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig, KVCacheGroup, KVCacheManager
from pagedllm.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager
from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_prep import BlockTableCache, plan_inputs


def test_block_table_cache_matches_fresh_tables() -> None:
    rng = random.Random(0)
    cache = BlockTableCache()
    lists = [[rng.randrange(1, 99) for _ in range(rng.randrange(0, 4))] for _ in range(6)]
    for step in range(200):
        for ids in lists:  # decode: some rows gain a block (sometimes several, as a chunked prefill does)
            if rng.random() < 0.3:
                ids.extend(rng.randrange(1, 99) for _ in range(rng.choice([1, 1, 1, 5])))
        if step % 17 == 0:  # the batch changes: a request leaves, one arrives (a new list), rows reorder
            lists.pop(rng.randrange(len(lists)))
            lists.insert(rng.randrange(len(lists) + 1), [rng.randrange(1, 99) for _ in range(rng.randrange(1, 3))])
        if step % 29 == 0:
            rng.shuffle(lists)
        got = cache.table(lists)
        width = max(1, max(len(ids) for ids in lists))
        want = np.zeros((len(lists), width), dtype=np.int32)
        for i, ids in enumerate(lists):
            want[i, : len(ids)] = ids
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        got[:] = -7  # the caller owns the returned array: scribbling on it must not reach the cache


def test_plan_inputs_with_table_caches_matches_without() -> None:
    tokens = [list(range(10 + i, 30 + i)) for i in range(4)]
    blocks = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]
    caches = [BlockTableCache()]
    for computed in ([0, 0, 0, 0], [10, 11, 12, 13], [11, 12, 13, 14]):
        sched = [1, 1, 1, 1] if computed[0] else [8, 8, 8, 8]
        decodes = 4 if computed[0] else 0
        a = plan_inputs(tokens, computed, sched, blocks, 4, decodes)
        b = plan_inputs(tokens, computed, sched, blocks, 4, decodes, table_caches=caches)
        for name in ("input_ids", "positions", "block_table", "slot_mapping", "logits_indices", "seq_lens"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _fields(m: SamplingMetadata) -> dict[str, object]:
    out: dict[str, object] = {}
    for name in ("temperature", "greedy_mask", "top_k", "top_p", "min_p", "presence_penalties",
                 "frequency_penalties", "repetition_penalties", "prompt_token_ids", "output_token_ids"):
        t = getattr(m, name)
        out[name] = None if t is None else t.tolist()
    out["mask"] = None if m.min_tokens_mask is None else [t.tolist() for t in m.min_tokens_mask]
    out["flags"] = (m.all_greedy, m.all_random, m.no_top_k, m.no_top_p, m.no_min_p, m.no_penalties,
                    m.max_num_logprobs, sorted(m.generators))
    assert m.logits_batch is not None
    out["batch"] = (m.logits_batch.output_token_ids, m.logits_batch.prompt_token_ids)
    return out


def test_sampling_metadata_reuse_matches_fresh_build() -> None:
    cpu = torch.device("cpu")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, min_tokens=3, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_p=0.5, frequency_penalty=0.2, logprobs=2),
    ]
    for p in params:
        p._all_stop_token_ids = {2, 9}
    gens: list[torch.Generator | None] = [None, torch.Generator().manual_seed(1), None]
    prompts = [[5, 6], [7, 8, 9], [10]]
    outputs: list[list[int]] = [[], [], []]
    previous: SamplingMetadata | None = None
    for step in range(5):
        for out in outputs:
            out.append(11 + step)  # min_tokens and the penalties' ids change with the outputs
        fresh = SamplingMetadata.build(params, gens, prompts, outputs, 32, cpu)
        reused = SamplingMetadata.build(params, gens, prompts, outputs, 32, cpu, reuse=previous)
        assert _fields(reused) == _fields(fresh), f"step {step}"
        if previous is not None:
            assert reused.temperature is previous.temperature  # the params tensors were kept
        previous = reused
    # Another request in a row (a new params object, even an equal one) is not served from the old tensors.
    assert previous is not None
    swapped = [params[0], SamplingParams(temperature=0.9), params[2]]
    rebuilt = SamplingMetadata.build(swapped, gens, prompts, outputs, 32, cpu, reuse=previous)
    assert rebuilt.temperature is not previous.temperature
    assert rebuilt.temperature.tolist()[1] == torch.tensor(0.9).item()


def _hybrid_manager() -> KVCacheManager:
    specs = [
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32),
        SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=8),
    ]
    config = KVCacheConfig(64, [KVCacheGroup(specs[0], [0]), KVCacheGroup(specs[1], [1])])
    return KVCacheManager(config, [FullAttentionManager, SlidingWindowManager], True, max_model_len=1024)


def test_take_new_block_ids_adds_up_to_the_block_table() -> None:
    for kv in (make_manager(num_blocks=64), _hybrid_manager()):
        req = make_request("a", list(range(7)))
        hits, num_hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens, num_hit, hits) is not None
        req.num_computed_tokens = req.num_tokens
        sent = [0] * kv.num_groups
        received = [list(ids) for ids in kv.take_new_block_ids("a", sent)]
        for token in range(20):
            req.output_token_ids.append(token)
            assert kv.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
            for group, ids in enumerate(kv.take_new_block_ids("a", sent)):
                received[group].extend(ids)
            # What the runner holds is the table, except for blocks a sliding window released since they
            # were sent (those it never reads again).
            for got, want in zip(received, kv.get_block_ids("a"), strict=True):
                assert len(got) == len(want)
                assert all(w == g or w == 0 for g, w in zip(got, want, strict=True))
            assert sent == [len(ids) for ids in kv.get_block_ids("a")]


def test_decode_slot_fast_path_caches_blocks_as_the_general_path() -> None:
    # Two identical requests: one grows through allocate_slots (fast path when it fits), the other is
    # forced through the general path; their cached-block registrations must stay the same.
    fast, slow = make_manager(num_blocks=64), make_manager(num_blocks=64)
    reqs = {id(fast): make_request("a", list(range(6))), id(slow): make_request("a", list(range(6)))}
    for kv in (fast, slow):
        assert kv.allocate_slots(reqs[id(kv)], 6) is not None
        reqs[id(kv)].num_computed_tokens = 6
    # Out of blocks: both paths refuse, and change nothing.
    tight = make_manager(num_blocks=3)  # the null block and two more
    req = make_request("t", list(range(8)))
    assert tight.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    req.output_token_ids.append(1)
    assert tight.allocate_slots(req, 1) is None
    assert len(tight.get_block_ids("t")[0]) == 2
    added: dict[int, list[list[list[int]]]] = {id(fast): [], id(slow): []}
    for token in range(30):
        for kv in (fast, slow):
            req = reqs[id(kv)]
            req.output_token_ids.append(100 + token)
            # Passing (empty) hits sends the slow one down the general path.
            new = kv.allocate_slots(req, 1, 0, kv.empty_blocks()) if kv is slow else kv.allocate_slots(req, 1)
            assert new is not None
            added[id(kv)].append(new.get_block_ids())
            req.num_computed_tokens += 1
        assert fast.get_block_ids("a") == slow.get_block_ids("a")
        assert added[id(fast)] == added[id(slow)]
        assert fast.coordinator.managers[0].num_cached_block == slow.coordinator.managers[0].num_cached_block
        assert len(fast.block_pool.cached_block_hash_to_block) == len(slow.block_pool.cached_block_hash_to_block)


def _plan_or_error(*args: object, **kwargs: object) -> object:
    try:
        return plan_inputs(*args, **kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        return str(e)


def test_small_decode_batches_plan_as_the_numpy_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token per request for a few requests (input_prep.SMALL_DECODE_BATCH) is planned with plain ints: the
    same arrays, dtypes and scalars as the numpy route, and the same error for a bad step, over random steps."""
    from pagedllm.worker import input_prep

    rng = random.Random(1)
    for step in range(300):
        num_reqs = rng.randrange(1, input_prep.SMALL_DECODE_BATCH + 1)
        bs = rng.choice([1, 4, 16])
        computed = [rng.randrange(0, 70) for _ in range(num_reqs)]
        tokens = [[rng.randrange(0, 500) for _ in range(c + 1 + rng.randrange(0, 3))] for c in computed]
        blocks = [[rng.randrange(1, 999) for _ in range(-(-(c + 1) // bs) + rng.randrange(0, 2))] for c in computed]
        if step % 10 == 0:  # a bad step: too few tokens, too few blocks, or a negative count
            i = rng.randrange(num_reqs)
            kind = rng.randrange(3)
            if kind == 0:
                tokens[i] = tokens[i][: computed[i]]
            elif kind == 1:
                blocks[i] = blocks[i][: computed[i] // bs]
            else:
                computed[i] = -1
        args = (tokens, computed, [1] * num_reqs, blocks, bs, num_reqs)
        fast = _plan_or_error(*args, table_caches=[BlockTableCache()])
        with monkeypatch.context() as m:
            m.setattr(input_prep, "SMALL_DECODE_BATCH", 0)
            slow = _plan_or_error(*args, table_caches=[BlockTableCache()])
        assert type(fast) is type(slow), (step, fast, slow)
        if isinstance(fast, str):
            assert fast == slow, step
            continue
        assert isinstance(fast, input_prep.HostInputs) and isinstance(slow, input_prep.HostInputs)
        for name, value in vars(slow).items():
            got = getattr(fast, name)
            if isinstance(value, np.ndarray):
                assert got.dtype == value.dtype, (step, name)
                np.testing.assert_array_equal(got, value, err_msg=f"step {step}: {name}")
            else:
                assert got == value, (step, name)
