"""Sliding-window KV manager: Mistral with a window shorter than its prompts gives transformers' greedy tokens
through chunked prefill, mixed batches, preemption and prefix hits, while each request holds a bounded number
of blocks however long it generates."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy_with

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.spec import SlidingWindowSpec
from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager

WINDOW, BLOCK = 8, 4
VOCAB = 384
MAX_BLOCKS = math.ceil(WINDOW / BLOCK) + 1  # the bound per request per sliding layer
NEW = 32
# A small cache: the CPU default (a GiB budget) costs seconds of zero-filling per engine.
SMALL: dict[str, Any] = {"num_kv_blocks": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _mistral_config(window: int | None) -> Any:
    import transformers

    return transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.25,  # peaked logits: greedy argmax is not decided by rounding (see tiny_models)
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        sliding_window=window,
        architectures=["MistralForCausalLM"],
    )


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    import transformers

    path = tiny_root / "mistral_window"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(_mistral_config(WINDOW)).float()
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def hf_ref(model_dir: str) -> Any:
    """transformers' greedy tokens (eager attention, which applies the window), memoised per prompt."""
    import transformers

    model = transformers.MistralForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(prompt: list[int], n: int = NEW) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy_with(model, prompt, n)[0]
        return cache[key]

    ref.model = model  # type: ignore[attr-defined]
    return ref


def _prompts(n: int, seed: int, lo: int = 12, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _ids(outputs: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _manager(engine: LLMEngine) -> SlidingWindowManager:
    managers = engine.parts.kv_cache_manager.coordinator.managers
    assert len(managers) == 1, "every Mistral layer has the same window: one KV-cache group"
    assert isinstance(managers[0], SlidingWindowManager)
    return managers[0]


def _null_block_untouched(engine: LLMEngine) -> bool:
    """Block 0 is only ever a placeholder: no real token's K/V may be written there (caches start zeroed)."""
    return all(not cache[:, 0].any() for cache in engine.parts.runner.kv_caches)


def _held(manager: SlidingWindowManager, rid: str) -> int:
    return sum(1 for b in manager.get_blocks(rid) if not b.is_null)


# --- the manager alone ----------------------------------------------------------------------------------


def _pool_and_manager(num_blocks: int = 32) -> tuple[BlockPool, SlidingWindowManager]:
    pool = BlockPool(num_blocks, enable_caching=True)
    spec = SlidingWindowSpec(BLOCK, 2, 16, torch.float32, sliding_window=WINDOW)
    return pool, SlidingWindowManager(spec, pool, 0)


def test_remove_skipped_blocks_exact_bound() -> None:
    pool, mgr = _pool_and_manager()
    mgr.allocate_new_blocks("r", 24)  # blocks 0..5 hold positions 0..23
    # n computed: the next token (position n) reads positions >= n - 7. Block 0 (positions 0..3) is last
    # read by the token at position 10, so it may go only once n = 11.
    mgr.remove_skipped_blocks("r", 10)
    assert not any(b.is_null for b in mgr.get_blocks("r"))
    mgr.remove_skipped_blocks("r", 11)
    assert [b.is_null for b in mgr.get_blocks("r")] == [True] + [False] * 5
    free_before = pool.get_num_free_blocks()
    mgr.remove_skipped_blocks("r", 19)  # reads positions >= 12: blocks 0..2 released
    assert [b.is_null for b in mgr.get_blocks("r")] == [True] * 3 + [False] * 3
    assert pool.get_num_free_blocks() == free_before + 2
    mgr.free("r")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_find_longest_cache_hit_window_semantics() -> None:
    pool, mgr = _pool_and_manager()
    hashes = [bytes([i]) for i in range(8)]
    mgr.allocate_new_blocks("r", 32)
    mgr.cache_blocks("r", hashes, 32)
    blocks = list(mgr.get_blocks("r"))
    # Everything cached: the whole max_length is a hit (full blocks only), and only its last two blocks are
    # read again, so the ones before are null (not touched, not ref-counted).
    hit = mgr.find_longest_cache_hit(hashes, 30)
    assert len(hit) == 7 and hit[5:] == blocks[5:7] and all(b.is_null for b in hit[:5])
    # Drop block 2's and block 5's hashes (evict them): a hit needs its last ceil(7 / 4) = 2 blocks cached.
    mgr.free("r")
    for b in (blocks[2], blocks[5]):
        pool.free_block_queue.remove(b)
        pool._evict(b)
        pool.free_block_queue.append(b)
    hit = mgr.find_longest_cache_hit(hashes, 32)
    # Longest prefix ending in two cached blocks: blocks 6, 7 -> 8 blocks, leading ones may be null.
    assert len(hit) == 8 and hit[6:] == blocks[6:8] and hit[5].is_null
    hit = mgr.find_longest_cache_hit(hashes, 27)  # at most 6 blocks: run 3, 4 (block 5 is missing)
    assert len(hit) == 5 and hit[3:] == blocks[3:5] and all(b.is_null for b in hit[:3])
    hit = mgr.find_longest_cache_hit(hashes[:3] + [b"x"] * 5, 32)  # only blocks 0, 1: a run from the start
    assert hit == blocks[:2]


# --- the engine against transformers ---------------------------------------------------------------------


def test_reference_uses_the_window(model_dir: str, hf_ref: Any) -> None:
    """Guard for every test below: transformers' reference really cuts the window."""
    import transformers

    full = transformers.MistralForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", sliding_window=None
    ).eval()
    prompts = _prompts(3, seed=0)
    assert any(hf_ref(p) != hf_greedy_with(full, p, NEW)[0] for p in prompts)


def test_chunked_mixed_batch_matches_transformers(model_dir: str, hf_ref: Any) -> None:
    prompts = _prompts(6, seed=1)
    # Budget 16 < most prompts: prefills are chunked and share steps with other requests' decodes.
    llm = LLM(
        model_dir,
        block_size=BLOCK,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        enable_prefix_caching=False,
        **SMALL,
    )
    assert llm.engine.parts.selections["kv_manager"].winner.name == "sliding_window"
    _manager(llm.engine)
    got = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [hf_ref(p) for p in prompts]
    assert llm.engine.kv_cache_usage == 0.0


def test_blocks_held_stay_bounded(model_dir: str, hf_ref: Any) -> None:
    engine = LLMEngine.from_kwargs(
        model_dir, block_size=BLOCK, max_num_batched_tokens=64, enable_prefix_caching=False, **SMALL
    )
    mgr = _manager(engine)
    prompts = {str(i): p for i, p in enumerate(_prompts(3, seed=2))}
    # ~4x the prompt, 12x the window.
    long_run = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, long_run)
    requests = engine.core.scheduler.requests
    finished: dict[str, list[int]] = {}
    decode_checks = 0
    while engine.has_unfinished_requests():
        # Before the step: what each request was allocated for it.
        decoding = {rid for rid, r in requests.items() if r.num_computed_tokens >= r.num_prompt_tokens}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        for rid in decoding & set(requests):
            # One new token per decode step: the window's positions plus it span <= ceil(W / bs) + 1 blocks.
            assert _held(mgr, rid) <= MAX_BLOCKS, f"request {rid} holds {_held(mgr, rid)} blocks"
            decode_checks += 1
    assert decode_checks > 200
    assert {rid: finished[rid] for rid in prompts} == {rid: hf_ref(p, 96) for rid, p in prompts.items()}
    assert engine.kv_cache_usage == 0.0


def test_preemption_and_abort_free_everything(model_dir: str, hf_ref: Any) -> None:
    prompts = _prompts(8, seed=3, lo=16, hi=21)
    # 14 blocks (13 usable, max_model_len 52 >= 20 + 32): decoding requests hold 3 blocks each, prefill chunks
    # more, so 8 requests do not fit at once and running ones get preempted.
    tight = LLM(model_dir, block_size=BLOCK, num_kv_blocks=14, max_num_seqs=8, enable_prefix_caching=False,
                admission_headroom_tokens=0)
    got = _ids(tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [hf_ref(p) for p in prompts]
    assert tight.engine.get_stats().num_preemptions > 0
    assert _null_block_untouched(tight.engine)
    assert tight.engine.kv_cache_usage == 0.0

    engine = LLMEngine.from_kwargs(model_dir, block_size=BLOCK, max_num_batched_tokens=32, **SMALL)
    for i, p in enumerate(prompts[:6]):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(12):  # past the window: some blocks are already released
        engine.step()
    assert engine.kv_cache_usage > 0
    engine.abort_request(["0", "2", "4"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_usage == 0.0
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"again{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(12):
        engine.step()
    engine.abort_request([f"again{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_usage == 0.0


def test_prefix_hits_longer_than_window(model_dir: str, hf_ref: Any) -> None:
    rng = random.Random(4)
    prefix = [rng.randrange(3, VOCAB) for _ in range(22)]  # > window: the hit starts with null blocks
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(5)]
    llm = LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=5, **SMALL)
    first = _ids(llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False))
    rest = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False))
    assert first + rest == [hf_ref(p) for p in prompts]
    assert _null_block_untouched(llm.engine)
    # Each later prompt reuses the prefix's 5 full blocks (its first 3 as null blocks: outside the window).
    assert llm.engine.get_stats().prefix_cache_hits >= 4 * 20
    assert llm.engine.kv_cache_usage == 0.0


@pytest.mark.parametrize("max_window_layers", [0, 1])
def test_qwen2_specs_follow_each_layers_window(max_window_layers: int) -> None:
    """All layers windowed -> one SlidingWindowSpec group; the bottom max_window_layers stay full."""
    from pagedllm.kv_cache.spec import FullAttentionSpec
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.models.llama.qwen2 import Qwen2ForCausalLM
    from pagedllm.protocols.model import ModelBuildContext

    cfg = _qwen2_config(num_layers=3, max_window_layers=max_window_layers)
    ctx = ModelBuildContext(cfg, torch.float32, torch.device("cpu"), TorchSDPABackend, None, BLOCK)
    specs = Qwen2ForCausalLM(ctx).kv_cache_specs()
    expected = [FullAttentionSpec] * max_window_layers + [SlidingWindowSpec] * (3 - max_window_layers)
    assert [type(s) for s in specs] == expected


def _qwen2_config(num_layers: int, max_window_layers: int) -> Any:
    import transformers

    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=max_window_layers,
        architectures=["Qwen2ForCausalLM"],
    )


def test_qwen2_mixed_window_layers_match_transformers_and_release_blocks(tiny_root: Path) -> None:
    """Qwen2 with its bottom layer full and the rest windowed: full and windowed KV-cache groups; greedy tokens equal
    transformers' (eager attention applies each layer's type) through chunked mixed batches, the windowed
    groups stay within ceil(W / bs) + 1 blocks per request while the full group keeps every block."""
    import transformers

    path = tiny_root / "qwen2_mixed_window"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(_qwen2_config(3, 1)).float().save_pretrained(path, safe_serialization=True)
    ref_model = transformers.Qwen2ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    full_model = transformers.Qwen2ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", layer_types=["full_attention"] * 3
    ).eval()
    prompts = _prompts(5, seed=5)
    expected = [hf_greedy_with(ref_model, p, NEW)[0] for p in prompts]
    assert any(e != hf_greedy_with(full_model, p, NEW)[0] for e, p in zip(expected, prompts))  # the window matters

    engine = LLMEngine.from_kwargs(
        str(path), block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=5, enable_prefix_caching=False,
        **SMALL,
    )
    managers = engine.parts.kv_cache_manager.coordinator.managers
    sliding = [m for m in managers if isinstance(m, SlidingWindowManager)]
    full = [m for m in managers if not isinstance(m, SlidingWindowManager)]
    # Groups hold equal layer counts (page sharing, core/kv_cache/layout.py): 1 full + 2 windowed -> 3 groups.
    assert len(sliding) == 2 and len(full) == 1
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    requests = engine.core.scheduler.requests
    got: dict[str, list[int]] = {}
    checks = 0
    while engine.has_unfinished_requests():
        decoding = {rid for rid, r in requests.items() if r.num_computed_tokens >= r.num_prompt_tokens}
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        for rid in decoding & set(requests):
            assert all(_held(m, rid) <= MAX_BLOCKS for m in sliding)
            assert len(full[0].get_blocks(rid)) == math.ceil(requests[rid].num_computed_tokens / BLOCK)
            checks += 1
    assert checks > 50
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert engine.kv_cache_usage == 0.0
