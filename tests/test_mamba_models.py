"""Mamba-1 and Mamba-2 through the engine: greedy tokens identical to transformers (float32, same weights) with
chunked prefill, mixed batches, forced preemption and aborts; one state block per running request whatever
its length, asserted from the block pool's counters."""

from __future__ import annotations

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
from pagedllm.kv_cache.spec import MambaSpec
from pagedllm.plugins.kvmanagers.mamba.manager import MambaManager

VOCAB = 384
BLOCK = 4
NEW = 32
SMALL: dict[str, Any] = {"num_kv_blocks": 64, "enable_prefix_caching": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
KINDS = ["mamba", "mamba2"]


def _config(kind: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4, expand=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if kind == "mamba":
        return transformers.MambaConfig(**common, time_step_rank=8, architectures=["MambaForCausalLM"])
    # 8 heads of 8 channels in 2 B/C groups; chunk 8 < most prompts, so the SSD crosses chunk boundaries.
    return transformers.Mamba2Config(
        **common, num_heads=8, head_dim=8, n_groups=2, chunk_size=8, architectures=["Mamba2ForCausalLM"]
    )


def _randomize(model: torch.nn.Module) -> None:
    """O(1) random weights everywhere (transformers' init leaves logits tiny and greedy ties likely)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embedding" in name:
                param.normal_(0.0, 1.0)
            elif name.endswith(("A_log", "dt_bias", "dt_proj.bias")):
                param.normal_(-0.5, 0.5)  # decays and step sizes of ordinary trained magnitudes
            else:
                param.normal_(0.0, 0.2)


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest, tiny_root: Path) -> tuple[str, Any]:
    """(checkpoint folder, memoised transformers greedy reference) for each Mamba generation."""
    import transformers

    kind: str = request.param
    path = tiny_root / f"{kind}_random"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = _config(kind)
        hf = getattr(transformers, config.architectures[0])(config).float().eval()
        _randomize(hf)
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path, safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(prompt: list[int], n: int = NEW) -> list[int]:
        # transformers' own cached greedy decode (its slow-path scan for the prompt, its state update per
        # token): O(n) where re-running the whole sequence per token is O(n^2). No EOS, so no logits
        # processor touches the argmax; test_reference_paths_agree checks it against full forwards.
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    ref.model = hf  # type: ignore[attr-defined]

    return str(path), ref


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _ids(outputs: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _states_held(engine: LLMEngine) -> int:
    pool = engine.parts.kv_cache_manager.block_pool
    return pool.num_blocks - 1 - pool.get_num_free_blocks()


# --- the manager alone ----------------------------------------------------------------------------------


def _pool_and_manager(num_blocks: int = 8) -> tuple[BlockPool, MambaManager]:
    pool = BlockPool(num_blocks, enable_caching=True)
    spec = MambaSpec(BLOCK, conv_state_shape=(6, 3), ssm_state_shape=(6, 4), dtype=torch.float32)
    return pool, MambaManager(spec, pool, 0)


def test_manager_one_state_block_per_request() -> None:
    pool, mgr = _pool_and_manager()
    assert mgr.get_num_blocks_to_allocate("a", 1000, []) == 1
    new = mgr.allocate_new_blocks("a", 10)
    assert len(new) == 3 and not new[0].is_null and all(b.is_null for b in new[1:])
    assert pool.get_num_free_blocks() == pool.num_blocks - 2
    # Growing never takes another real block, only null padding that keeps the table index-aligned.
    assert mgr.get_num_blocks_to_allocate("a", 5000, []) == 0
    more = mgr.allocate_new_blocks("a", 30)
    assert len(mgr.get_blocks("a")) == 8 and all(b.is_null for b in more)
    assert pool.get_num_free_blocks() == pool.num_blocks - 2
    mgr.allocate_new_blocks("b", 1)
    assert pool.get_num_free_blocks() == pool.num_blocks - 3
    # No prefix caching: nothing is registered, nothing is ever a hit.
    mgr.cache_blocks("a", [b"h"] * 8, 30)
    assert pool.counters.blocks_cached == 0 and mgr.find_longest_cache_hit([b"h"] * 8, 30) == []
    mgr.free("a")
    mgr.free("b")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    # Freed and re-admitted (preemption): a fresh state block again.
    assert mgr.get_num_blocks_to_allocate("a", 12, []) == 1


def test_manager_refuses_other_specs() -> None:
    from pagedllm.kv_cache.spec import FullAttentionSpec

    with pytest.raises(ValueError, match="MambaSpec"):
        MambaManager(FullAttentionSpec(BLOCK, 2, 16, torch.float32), BlockPool(4, False), 0)


# --- the engine against transformers ---------------------------------------------------------------------


def test_reference_paths_agree(model: tuple[str, Any]) -> None:
    """The cached reference equals transformers' plain full-forward argmax loop (tiny_models.hf_greedy_with)."""
    _, ref = model
    prompt = _prompts(1, seed=9)[0]
    assert ref(prompt) == hf_greedy_with(ref.model, prompt, NEW)[0]


def test_chunked_mixed_batch_matches_transformers(model: tuple[str, Any]) -> None:
    path, ref = model
    prompts = _prompts(6, seed=1) + [[7]]  # a one-token prompt is scheduled like a decode with a fresh state
    # Budget 16 < most prompts: prefills are chunked (the state carried across chunks) and share steps with
    # other requests' decodes.
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=7, **SMALL)
    parts = llm.engine.parts
    assert parts.selections["kv_manager"].winner.name == "mamba"
    assert isinstance(parts.kv_cache_manager.coordinator.managers[0], MambaManager)
    got = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [ref(p) for p in prompts]
    assert llm.engine.kv_cache_usage == 0.0


def test_state_count_equals_running_requests(model: tuple[str, Any]) -> None:
    path, ref = model
    engine = LLMEngine.from_kwargs(path, block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4, **SMALL)
    scheduler = engine.core.scheduler
    long_run = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = {str(i): p for i, p in enumerate(_prompts(6, seed=2, lo=3, hi=40))}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, long_run)
    finished: dict[str, list[int]] = {}
    counts = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        # One state block per running request, from prompt to ~100 tokens: the count never follows length.
        assert _states_held(engine) == len(scheduler.running)
        counts.add(len(scheduler.running))
    assert max(counts) == 4  # max_num_seqs bounded the batch, not memory
    assert finished == {rid: ref(p, 64) for rid, p in prompts.items()}
    assert engine.kv_cache_usage == 0.0


def test_memory_pressure_and_forced_preemption(model: tuple[str, Any]) -> None:
    path, ref = model
    prompts = _prompts(5, seed=3, lo=10, hi=25)
    # 3 blocks = 2 states: only two requests run at once whatever max_num_seqs says; the rest wait.
    tight = LLM(path, block_size=BLOCK, num_kv_blocks=3, max_num_seqs=5, enable_prefix_caching=False)
    assert tight.engine.parts.max_model_len >= 512  # a state does not grow: the length is not bounded by blocks
    got = _ids(tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [ref(p) for p in prompts]
    assert tight.engine.kv_cache_usage == 0.0

    # A Mamba request never needs a second block, so the scheduler never preempts one on its own; preempt
    # running requests mid-prefill and mid-decode as it would, and check recompute rebuilds the same state.
    engine = LLMEngine.from_kwargs(path, block_size=BLOCK, max_num_batched_tokens=8, **SMALL)
    scheduler = engine.core.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    finished: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in (2, 9, 20) and scheduler.running:
            scheduler.preempt(scheduler.running.pop())
            assert _states_held(engine) == len(scheduler.running)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.get_stats().num_preemptions == 3
    assert [finished[str(i)] for i in range(len(prompts))] == [ref(p) for p in prompts]
    assert engine.kv_cache_usage == 0.0


def test_abort_frees_states(model: tuple[str, Any]) -> None:
    path, ref = model
    engine = LLMEngine.from_kwargs(path, block_size=BLOCK, max_num_batched_tokens=16, **SMALL)
    prompts = _prompts(5, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(6):
        engine.step()
    assert _states_held(engine) == 5
    engine.abort_request(["0", "3"])
    assert _states_held(engine) == 3
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    # The survivors' states were untouched by the aborted ones' freed (and possibly reused) blocks.
    assert {rid: finished[rid] for rid in ("1", "2", "4")} == {str(i): ref(prompts[i]) for i in (1, 2, 4)}
    assert engine.kv_cache_usage == 0.0
