"""Gemma 2 and Gemma 3 against transformers (float32, same weights): greedy tokens and log-probs through
chunked prefill and mixed batches with prompts longer than the window, with local and global layers in
separate KV-cache groups; the local groups stay bounded, and preemption and abort free every group."""

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
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager
from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager

WINDOW, BLOCK, VOCAB, NEW, TOP_N = 8, 4, 384, 32, 5
MAX_BLOCKS = math.ceil(WINDOW / BLOCK) + 1  # the bound per request per sliding layer group
SMALL: dict[str, Any] = {"num_kv_blocks": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _config(kind: str, window: int = WINDOW) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Small init: Gemma scales the embedding by sqrt(hidden), and a wider init makes every step repeat one
        # token, which would hide window bugs. The top-2 log-prob gap stays > 1e-3, far above float32 noise.
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        sliding_window=window,
        query_pre_attn_scalar=16,
        final_logit_softcapping=10.0,  # small caps, so a missing cap shows in the log-probs
        architectures=["Gemma2ForCausalLM" if kind == "gemma2" else "Gemma3ForCausalLM"],
    )
    if kind == "gemma2":  # 4 layers: local, global, local, global
        return transformers.Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=5.0)
    # 6 layers: 5 local, 1 global; a local RoPE base and a linearly scaled global RoPE, as in Gemma 3 4B+.
    return transformers.Gemma3TextConfig(
        **common,
        num_hidden_layers=6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    )


def _save(kind: str, root: Path) -> str:
    import transformers

    path = root / f"{kind}_window"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cls = transformers.Gemma2ForCausalLM if kind == "gemma2" else transformers.Gemma3ForCausalLM
        model = cls(_config(kind)).float()
        with torch.no_grad():  # Gemma norms start at zero (a scale of 1): randomise them so they matter
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tiny_root: Path) -> tuple[str, str, Any]:
    """(kind, checkpoint folder, memoised transformers greedy reference: prompt, n -> (tokens, logprobs))."""
    import transformers

    kind = request.param
    path = _save(kind, tiny_root)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]] = {}

    def ref(prompt: list[int], n: int = NEW) -> tuple[list[int], torch.Tensor]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy_with(model, prompt, n)
        return cache[key]

    return kind, path, ref


def _prompts(n: int, seed: int, lo: int = 12, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _ids(outputs: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _managers(engine: LLMEngine) -> list[Any]:
    return list(engine.parts.kv_cache_manager.coordinator.managers)


def _held(manager: Any, rid: str) -> int:
    return sum(1 for b in manager.get_blocks(rid) if not b.is_null)


def _all_groups_empty(engine: LLMEngine) -> bool:
    pool: BlockPool = engine.parts.kv_cache_manager.block_pool
    return (
        all(not m.req_to_blocks for m in _managers(engine))
        and pool.get_num_free_blocks() == pool.num_blocks - 1
        and engine.kv_cache_usage == 0.0
    )


def test_reference_uses_the_window(tiny_root: Path) -> None:
    """Guard for the tests below: transformers' Gemma 2 really cuts the window on these prompts."""
    import transformers

    path = _save("gemma2", tiny_root)
    windowed, full = (
        transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", **extra
        ).eval()
        for extra in ({}, {"sliding_window": 4096})
    )
    prompts = _prompts(3, seed=1)
    assert any(hf_greedy_with(windowed, p, NEW)[0] != hf_greedy_with(full, p, NEW)[0] for p in prompts)


def test_greedy_and_logprobs_match_transformers(gemma: tuple[str, str, Any]) -> None:
    kind, path, ref = gemma
    prompts = _prompts(5, seed=1, hi=40)
    # Budget 16 < most prompts: prefills are chunked and share steps with other requests' decodes.
    llm = LLM(
        path,
        block_size=BLOCK,
        max_num_batched_tokens=16,
        max_num_seqs=5,
        enable_prefix_caching=False,
        **SMALL,
    )
    managers = _managers(llm.engine)
    # Gemma 2: local and global layers, 2 each -> 2 groups. Gemma 3: 5 local, 1 global -> 6 groups of 1 layer.
    expected = (
        [SlidingWindowManager, FullAttentionManager]
        if kind == "gemma2"
        else [SlidingWindowManager] * 5 + [FullAttentionManager]
    )
    assert [type(m) for m in managers] == expected
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP_N)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    max_delta = 0.0
    for out, prompt in zip(outputs, prompts, strict=True):
        hf_tokens, hf_logprobs = ref(prompt)
        assert out.outputs[0].token_ids == hf_tokens
        for step, position in enumerate(out.outputs[0].logprobs or []):
            for tid, lp in position.items():
                max_delta = max(max_delta, abs(lp.logprob - hf_logprobs[step, tid].item()))
    print(f"{kind}: max |Δ logprob| vs transformers over top-{TOP_N} x {NEW} steps = {max_delta:.2e}")
    assert max_delta < 1e-4
    assert _all_groups_empty(llm.engine)


def test_local_groups_stay_bounded(gemma: tuple[str, str, Any]) -> None:
    kind, path, ref = gemma
    engine = LLMEngine.from_kwargs(
        path, block_size=BLOCK, max_num_batched_tokens=64, enable_prefix_caching=False, **SMALL
    )
    managers = _managers(engine)
    sliding = [m for m in managers if isinstance(m, SlidingWindowManager)]
    full = [m for m in managers if isinstance(m, FullAttentionManager)]
    assert sliding and full
    prompts = {str(i): p for i, p in enumerate(_prompts(2, seed=2))}
    long_run = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)  # 10x the window
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, long_run)
    requests = engine.core.scheduler.requests
    finished: dict[str, list[int]] = {}
    checks = 0
    while engine.has_unfinished_requests():
        decoding = {rid for rid, r in requests.items() if r.num_computed_tokens >= r.num_prompt_tokens}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        for rid in decoding & set(requests):
            for m in sliding:  # the bound, from the managers' own block lists
                assert _held(m, rid) <= MAX_BLOCKS, f"request {rid} holds {_held(m, rid)} local blocks"
            # ... while the global group keeps every block of the context.
            length = requests[rid].num_computed_tokens
            assert all(_held(m, rid) == math.ceil(length / BLOCK) for m in full)
            checks += 1
    assert checks > 100
    assert finished == {rid: ref(p, 80)[0] for rid, p in prompts.items()}
    assert _all_groups_empty(engine)


def test_preemption_and_abort_free_every_group(gemma: tuple[str, str, Any]) -> None:
    kind, path, ref = gemma
    prompts = _prompts(6, seed=3, lo=16, hi=21)
    # Decoding, a request holds ceil(52 / 4) = 13 global blocks and <= 3 per local group: 6 requests need
    # more than the pool's usable blocks, so running ones get preempted (max_model_len stays >= 52).
    blocks = 80 if kind == "gemma3" else 48
    tight = LLM(path, block_size=BLOCK, num_kv_blocks=blocks, max_num_seqs=6, enable_prefix_caching=False,
                admission_headroom_tokens=0)
    assert tight.engine.parts.max_model_len >= 20 + NEW
    got = _ids(tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [ref(p)[0] for p in prompts]
    assert tight.engine.get_stats().num_preemptions > 0
    assert _all_groups_empty(tight.engine)

    engine = LLMEngine.from_kwargs(path, block_size=BLOCK, max_num_batched_tokens=32, **SMALL)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(12):  # past the window: local groups have released blocks already
        engine.step()
    assert engine.kv_cache_usage > 0
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert _all_groups_empty(engine)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"again{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(6):
        engine.step()
    engine.abort_request([f"again{i}" for i in range(3)])
    assert not engine.has_unfinished_requests()
    assert _all_groups_empty(engine)


def test_prefix_hits_across_groups(gemma: tuple[str, str, Any]) -> None:
    """A shared prefix longer than the window: every group agrees on the hit (local ones with null blocks)."""
    kind, path, ref = gemma
    rng = random.Random(4)
    prefix = [rng.randrange(3, VOCAB) for _ in range(22)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4, **SMALL)
    first = _ids(llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False))
    rest = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False))
    assert first + rest == [ref(p)[0] for p in prompts]
    assert llm.engine.get_stats().prefix_cache_hits >= 3 * 20
    assert llm.engine.kv_cache_usage == 0.0
