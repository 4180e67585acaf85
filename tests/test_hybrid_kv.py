"""Hybrid KV caches: grouping and page sharing (kv_cache/layout.py), the capacity report and window-aware
length (kv_cache/capacity.py), per-group block tables in the runner's inputs, and each attention layer
reading its own group's table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gemma import _save

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.capacity import KVCapacity
from pagedllm.kv_cache.layout import KVCacheLayout, bind_kv_groups, group_layers
from pagedllm.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.layers.attention import Attention
from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.protocols.attention import KVGroupMetadata
from pagedllm.protocols.model import ModelBuildContext
from pagedllm.worker.cuda_graphs import StepBuffers
from pagedllm.worker.input_prep import build_attn_metadata, plan_inputs, prepare_inputs

CPU = torch.device("cpu")


def _specs(
    pattern: str, block: int = 16, window: int = 4096, heads: int = 8, head: int = 256
) -> list[KVCacheSpec]:
    """'L' = local (sliding window), 'G' = global (full attention), one letter per layer."""
    full = FullAttentionSpec(block, heads, head, torch.bfloat16)
    local = SlidingWindowSpec(block, heads, head, torch.bfloat16, sliding_window=window)
    return [local if c == "L" else full for c in pattern]


# --- grouping and page sharing -----------------------------------------------------------------------------


def test_groups_split_to_equal_sizes() -> None:
    gemma2 = group_layers(_specs("LG" * 4))
    assert [(type(g.spec), g.layer_indices) for g in gemma2] == [
        (SlidingWindowSpec, [0, 2, 4, 6]),
        (FullAttentionSpec, [1, 3, 5, 7]),
    ]
    gemma3 = group_layers(_specs("LLLLLG" * 2))  # 10 local, 2 global -> 6 groups of 2
    assert [len(g.layer_indices) for g in gemma3] == [2] * 6
    assert sum(isinstance(g.spec, SlidingWindowSpec) for g in gemma3) == 5
    assert gemma3[0].layer_indices == [0, 1] and gemma3[-1].layer_indices == [5, 11]
    uneven = group_layers(_specs("G" * 20 + "L" * 30))  # no n:1 pattern: the last local group is padded
    assert [len(g.layer_indices) for g in uneven] == [20, 20, 10]
    close = group_layers(_specs("G" * 5 + "L" * 6))  # within 25%: one group each, the smaller padded
    assert [len(g.layer_indices) for g in close] == [5, 6]


def test_page_sharing_lowers_bytes_per_block() -> None:
    specs = _specs("LG" * 21)  # Gemma-2-9B's 42 layers
    page = specs[0].page_size_bytes
    shared = KVCacheLayout.plan(specs)
    separate = KVCacheLayout.plan(specs, share_pages=False)
    assert separate.bytes_per_block == 42 * page
    assert shared.bytes_per_block == 21 * page  # layer j of the local and of the global group share tensor j
    assert shared.layer_slots[:4] == [0, 0, 1, 1] and shared.padding_slots() == 0
    gemma3 = KVCacheLayout.plan(_specs("LLLLLG" * 4))
    assert gemma3.bytes_per_block == 4 * page and len(gemma3.groups) == 6
    padded = KVCacheLayout.plan(_specs("G" * 20 + "L" * 30))
    assert padded.bytes_per_block == 20 * page and padded.padding_slots() == 10
    # Another page layout never shares: its layers get their own tensors.
    other = _specs("GG", head=128) + _specs("LL")
    mixed = KVCacheLayout.plan(other)
    assert mixed.bytes_per_block == 2 * other[0].page_size_bytes + 2 * page

    tiny = KVCacheLayout.plan(_specs("LGLG", block=4, heads=2, head=8))
    caches = tiny.allocate(TorchSDPABackend, 5, CPU)
    assert caches[0] is caches[1] and caches[2] is caches[3] and caches[0] is not caches[2]


def test_engine_shares_pages(tiny_root: Path) -> None:
    """Same memory budget: the hybrid layout holds twice the blocks of treating local layers as global."""
    path = _save("gemma2", tiny_root)
    budget = {"block_size": 4, "kv_cache_memory_gb": 2**-14}  # 64 KiB
    hybrid = LLMEngine.from_kwargs(path, **budget)
    full = LLMEngine.from_kwargs(path, disable_sliding_window=True, **budget)
    page = 2 * 4 * 2 * 16 * 4  # K and V x block 4 x 2 KV heads x head 16 x float32
    assert hybrid.parts.capacity is not None and full.parts.capacity is not None
    assert hybrid.parts.capacity.layout.bytes_per_block == 2 * page
    assert full.parts.capacity.layout.bytes_per_block == 4 * page
    assert len({id(c) for c in hybrid.parts.runner.kv_caches}) == 2
    assert len(full.parts.kv_cache_manager.coordinator.managers) == 1
    assert hybrid.parts.num_blocks == 2 * full.parts.num_blocks == 2**16 // (2 * page)
    report = hybrid.parts.describe()
    assert "group 0: SlidingWindowSpec, 2 layers" in report and "ceil(8/4)+1 = 3 blocks" in report


# --- capacity --------------------------------------------------------------------------------------------


def test_capacity_counts_the_window_bound() -> None:
    layout = KVCacheLayout.plan(_specs("LG" * 21))
    decode = KVCapacity(layout, num_blocks=1_000_001, max_chunk=1)
    # An 8k request decoding: 512 global blocks plus ceil(4096 / 16) + 1 = 257 local ones.
    assert decode.blocks_per_request(8192) == 512 + 257
    full = KVCapacity(KVCacheLayout.plan(_specs("G" * 42)), num_blocks=1_000_001, max_chunk=1)
    # Same bytes: the full layout's blocks are twice as large, so it has half as many.
    full = KVCapacity(full.layout, num_blocks=500_001, max_chunk=1)
    ratio = decode.requests_that_fit(8192) / full.requests_that_fit(8192)
    # 2 L / (L + W + bs) = 1.33 at L = 8k, W = 4k: the most a half-local layout can save at that length.
    assert ratio == pytest.approx(2 * 8192 / (8192 + 4096 + 16), rel=0.02)
    assert decode.requests_that_fit(32768) / full.requests_that_fit(32768) > 1.6
    # A chunk of c tokens holds the window before it plus c.
    assert (
        KVCapacity(layout, 10_001, max_chunk=2048).blocks_per_request(8192) == 512 + math.ceil(6143 / 16) + 1
    )


def test_max_len_is_window_aware() -> None:
    local = KVCapacity(KVCacheLayout.plan(_specs("LL", block=4, window=8)), num_blocks=16, max_chunk=8)
    # A pure sliding-window model: a request holds <= cdiv(7 + 8, 4) + 1 = 5 blocks, whatever its length.
    assert local.blocks_per_request(10**6) == 5
    assert local.max_len(131072) == 131072
    mixed = KVCapacity(KVCacheLayout.plan(_specs("LG", block=4, window=8)), num_blocks=16, max_chunk=8)
    # 15 usable blocks: L tokens need cdiv(L, 4) global + min(cdiv(L, 4), 5) local blocks.
    assert mixed.max_len(131072) == 40 and mixed.blocks_per_request(40) == 15
    assert mixed.blocks_per_request(41) == 16


# --- per-group inputs and metadata -----------------------------------------------------------------------


def _two_group_step() -> tuple[list[list[int]], list[int], list[int], list[list[int]], list[list[int]]]:
    # two decodes, then a prefill chunk; group 0 block size 4, group 1 block size 8
    tokens = [list(range(10)), list(range(5)), list(range(9))]
    return tokens, [9, 4, 2], [1, 1, 5], [[3, 4, 5], [6, 7], [8, 9, 2]], [[11, 12], [13], [14, 15]]


def test_plan_inputs_per_group_slots() -> None:
    tokens, computed, sched, group0, group1 = _two_group_step()
    host = plan_inputs(tokens, computed, sched, group0, 4, 2, [(group1, 8)])
    assert host.slot_mapping.tolist() == [
        5 * 4 + 1,
        7 * 4 + 0,
        8 * 4 + 2,
        8 * 4 + 3,
        9 * 4 + 0,
        9 * 4 + 1,
        9 * 4 + 2,
    ]
    (extra,) = host.extra_groups
    assert extra.block_size == 8
    assert extra.block_table.tolist() == [[11, 12], [13, 0], [14, 15]]
    assert extra.slot_mapping.tolist() == [
        12 * 8 + 1,
        13 * 8 + 4,
        14 * 8 + 2,
        14 * 8 + 3,
        14 * 8 + 4,
        14 * 8 + 5,
        14 * 8 + 6,
    ]
    with pytest.raises(ValueError, match="KV-cache group 1: request 0"):
        plan_inputs(tokens, computed, sched, group0, 4, 2, [([[11], [13], [14]], 8)])
    fresh = prepare_inputs(tokens, computed, sched, group0, 4, CPU, 2, [(group1, 8)])
    assert [g.block_size for g in fresh.group_attn] == [4, 8]
    assert fresh.group_attn[1].slot_mapping.tolist() == extra.slot_mapping.tolist()
    assert fresh.group_attn[1].seq_lens is fresh.attn.seq_lens  # shared, not copied per group
    single = prepare_inputs(tokens, computed, sched, group0, 4, CPU, 2)
    assert not isinstance(build_attn_metadata(TorchSDPABackend, single), KVGroupMetadata)
    assert len(build_attn_metadata(TorchSDPABackend, fresh)) == 2


def test_step_buffers_per_group_match_fresh_tensors() -> None:
    tokens, computed, sched, group0, group1 = _two_group_step()
    fresh = prepare_inputs(tokens, computed, sched, group0, 4, CPU, 2, [(group1, 8)])
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=8, device=CPU, num_groups=2)
    big = [list(range(1, 9))] * 4
    buffers.load(plan_inputs([list(range(30))] * 4, [0] * 4, [4] * 4, big, 4, 0, [(big, 8)]))  # stale data
    got = buffers.load(plan_inputs(tokens, computed, sched, group0, 4, 2, [(group1, 8)]))
    for want, have in zip(fresh.group_attn, got.group_attn, strict=True):
        width = want.block_table.shape[1]
        assert torch.equal(have.block_table[:, :width], want.block_table)
        assert torch.equal(have.slot_mapping, want.slot_mapping) and have.block_size == want.block_size
    padded = buffers.load(
        plan_inputs(tokens[:2], computed[:2], sched[:2], group0[:2], 4, 2, [(group1[:2], 8)]), 4
    )
    assert padded.extra_groups[0].slot_mapping.tolist()[2:] == [0, 0]  # padding rows: the null block
    assert padded.extra_groups[0].block_table[2:, 0].tolist() == [0, 0]


def test_each_layer_reads_its_groups_table() -> None:
    """Group 0's table points at garbage, group 1's at the real context: a group-1 layer must not notice."""
    ctx = ModelBuildContext(None, torch.float32, CPU, TorchSDPABackend, None, 4)
    layer = Attention(ctx, 4, 8, 2, 8**-0.5, prefix="layer")
    gen = torch.Generator().manual_seed(0)
    tokens, computed, sched, group0, _ = _two_group_step()
    q, k, v = (torch.randn(7, h * 8, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(2, 32, 4, 2, 8, generator=gen)
    relocated = [[b + 16 for b in ids] for ids in group0]  # the same context, 16 blocks higher (a copy)
    cache[:, 16:] = cache[:, :16].clone()
    want = layer(
        q,
        k,
        v,
        cache.clone(),
        build_attn_metadata(TorchSDPABackend, prepare_inputs(tokens, computed, sched, group0, 4, CPU, 2)),
    )
    hybrid = prepare_inputs(
        tokens, computed, sched, [[1, 1, 1], [1, 1], [1, 1, 1]], 4, CPU, 2, [(relocated, 4)]
    )
    layer.kv_group_id = 1
    got = layer(q, k, v, cache.clone(), build_attn_metadata(TorchSDPABackend, hybrid))
    assert torch.allclose(got, want, atol=1e-6)
    layer.kv_group_id = 0
    assert not torch.allclose(
        layer(q, k, v, cache.clone(), build_attn_metadata(TorchSDPABackend, hybrid)), want
    )


def test_bind_kv_groups_needs_one_layer_per_spec() -> None:
    ctx = ModelBuildContext(None, torch.float32, CPU, TorchSDPABackend, None, 4)
    model = torch.nn.ModuleList([Attention(ctx, 4, 8, 2, 1.0) for _ in range(4)])
    bind_kv_groups(model, KVCacheLayout.plan(_specs("LGLG", block=4, heads=2, head=8)))
    assert [m.kv_group_id for m in model] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="6 KV-cache specs over 2 groups, but 4 modules declare kv_group_id"):
        bind_kv_groups(model, KVCacheLayout.plan(_specs("LGLGLG", block=4, heads=2, head=8)))


# --- the triton backend on a hybrid model ----------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backend_runs_hybrid_groups(tiny_root: Path) -> None:
    """Gemma 2 (window, soft-cap, two groups) through the Triton kernels, in Triton's interpreter, against the
    torch backend. A child process: TRITON_INTERPRET must be set before triton is first imported (see
    tests/test_triton_attention.py)."""
    path = _save("gemma2", tiny_root)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, __file__, path], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["groups"] == 2
    assert result["same_tokens"], result
    assert result["max_delta"] < 1e-4, result


def _triton_vs_torch(path: str) -> dict[str, object]:
    import random

    from pagedllm import LLM, SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(10, 20))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = {}
    groups = 0
    for backend in ("triton", "torch"):
        llm = LLM(path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=64, attention_backend=backend)
        groups = len(llm.engine.parts.kv_cache_manager.coordinator.managers)
        outs[backend] = [
            o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
    delta = max(
        abs(lp.logprob - ref.logprobs[i][tid].logprob)
        for got, ref in zip(outs["triton"], outs["torch"], strict=True)
        for i, position in enumerate(got.logprobs or [])
        for tid, lp in position.items()
        if ref.logprobs and tid in ref.logprobs[i]
    )
    same = [o.token_ids for o in outs["triton"]] == [o.token_ids for o in outs["torch"]]
    return {"groups": groups, "same_tokens": same, "max_delta": delta}


if __name__ == "__main__":  # the child process of test_triton_backend_runs_hybrid_groups
    print(json.dumps(_triton_vs_torch(sys.argv[1])))
