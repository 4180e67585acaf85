"""Llama 4 text (transformers' Llama4ForCausalLM) against transformers (float32, same weights, eager attention):
greedy tokens and log-probs through chunked prefill and mixed batches, prompts crossing chunk edges; the
chunked-local and NoPE layers in two KV-cache groups, the chunked one giving earlier chunks' blocks back while
the request runs, every group empty at the end; prefix hits across chunk edges give the same tokens; chunking,
the qk L2 norm, attention temperature tuning and top-k routing each change transformers' tokens on these
prompts, so the match is not an accident; only backends that mask by chunk are selected; the torch and flex
backends' chunked attention equal transformers' eager attention under its chunked mask at the kernel level,
with the released blocks' memory holding garbage."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy_with

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.plugins.kvmanagers.chunked_local.manager import ChunkedLocalManager
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager

CHUNK, BLOCK, VOCAB, NEW, TOP_N = 8, 4, 384, 24, 5
# One thread: tiny matmuls gain nothing from a second one on two shared cores, and lose much when busy.
SMALL: dict[str, Any] = {"num_kv_blocks": 256, "num_threads": 1}


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Iterator[None]:
    """The engines here set torch's process-wide thread count (num_threads 1); later modules get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _config(**overrides: Any) -> Any:
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,  # each expert's and the shared expert's
        intermediate_size_mlp=96,  # the dense layers'
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        interleave_moe_layer_step=2,  # layers 1 and 3 MoE, 0 and 2 dense
        no_rope_layer_interval=2,  # layers 0 and 2 RoPE + chunked local, 1 and 3 NoPE + full
        attention_chunk_size=CHUNK,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,  # a temperature step every 4 positions, so these short prompts see it
        attn_scale=0.5,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # A wide init keeps the random model's logits peaked, so greedy argmax is not decided by rounding.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Llama4ForCausalLM"],
    )
    fields.update(overrides)
    return transformers.Llama4TextConfig(**fields)


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    import transformers

    path = tiny_root / "llama4_chunked"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.Llama4ForCausalLM(_config()).float()
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    with _one_thread():
        return hf_greedy_with(model, prompt, n)


def _hf(path: str, **overrides: Any) -> Any:
    import transformers

    return transformers.Llama4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **overrides
    ).eval()


@pytest.fixture(scope="module")
def ref(model_dir: str) -> Any:
    """transformers' greedy tokens and log-probs, memoised per prompt."""
    model = _hf(model_dir)
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]] = {}

    def run(prompt: list[int], n: int = NEW) -> tuple[list[int], torch.Tensor]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = _greedy(model, prompt, n)
        return cache[key]

    return run


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


PROMPTS = _prompts(4, seed=1)  # 9, 11, 12 and 18 tokens, then 24 more: each crosses chunk edges of 8


def _managers(engine: LLMEngine) -> list[Any]:
    return list(engine.parts.kv_cache_manager.coordinator.managers)


def _all_groups_empty(engine: LLMEngine) -> bool:
    pool: BlockPool = engine.parts.kv_cache_manager.block_pool
    return (
        all(not m.req_to_blocks for m in _managers(engine))
        and pool.get_num_free_blocks() == pool.num_blocks - 1
        and engine.kv_cache_usage == 0.0
    )


def test_the_reference_depends_on_chunks_qk_norm_temperature_and_routing(model_dir: str, ref: Any) -> None:
    """Guard for the tests below: each feature changes transformers' own tokens on these prompts."""
    config = _config()
    assert config.layer_types == ["chunked_attention", "full_attention"] * 2 and config.moe_layers == [1, 3]
    prompts = sorted(PROMPTS, key=len)[-2:]
    expected = [ref(p)[0] for p in prompts]
    variants = [
        _hf(model_dir, attention_chunk_size=4096),  # the chunked layers see the whole context
        _hf(model_dir, use_qk_norm=False),
        _hf(model_dir, attn_temperature_tuning=False),
        _hf(model_dir, num_experts_per_tok=1),
    ]
    for variant in variants:
        assert any(_greedy(variant, p, NEW)[0] != e for p, e in zip(prompts, expected, strict=True))


def test_greedy_and_logprobs_match_transformers(model_dir: str, ref: Any) -> None:
    # Budget 16 < most prompts: prefills are chunked and share steps with other requests' decodes.
    llm = LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False,
              **SMALL)
    assert [type(m) for m in _managers(llm.engine)] == [ChunkedLocalManager, FullAttentionManager]
    assert llm.engine.parts.selections["attention"].winner.name == "torch"
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP_N)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    max_delta = 0.0
    for out, prompt in zip(outputs, PROMPTS, strict=True):
        hf_tokens, hf_logprobs = ref(prompt)
        assert out.outputs[0].token_ids == hf_tokens
        for step, position in enumerate(out.outputs[0].logprobs or []):
            for tid, lp in position.items():
                max_delta = max(max_delta, abs(lp.logprob - hf_logprobs[step, tid].item()))
    print(f"llama4: max |Δ logprob| vs transformers over top-{TOP_N} x {NEW} steps = {max_delta:.2e}")
    assert max_delta < 1e-4
    assert _all_groups_empty(llm.engine)


def _run_watching_blocks(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
    """Run one request to the end step by step; check the chunked group's blocks after every step."""
    chunked, full = _managers(engine)
    pool: BlockPool = engine.parts.kv_cache_manager.block_pool
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    requests = engine.core.scheduler.requests
    seen: dict[str, Any] = {"cached": requests[rid].num_cached_tokens, "released": 0, "max_real": 0}
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        request = requests.get(rid)
        if request is None:
            continue
        seen["cached"] = request.num_cached_tokens
        computed = request.num_computed_tokens
        blocks = chunked.get_blocks(rid)
        real = [b for b in blocks if not b.is_null]
        nulls = len(blocks) - len(real)
        chunk_start_block = computed // CHUNK * CHUNK // BLOCK
        # Held: exactly the blocks from the current chunk's start; all before it are back in the pool, free.
        assert nulls <= chunk_start_block and all(not b.is_null for b in blocks[chunk_start_block:])
        assert len(real) <= -(-(CHUNK - 1 + 16) // BLOCK) + 1  # the spec's bound at a 16-token step budget
        assert len(full.get_blocks(rid)) == -(-computed // BLOCK) or computed == 0
        held = len(real) + sum(1 for b in full.get_blocks(rid) if not b.is_null)
        assert pool.get_num_free_blocks() == pool.num_blocks - 1 - held  # released blocks count as free
        seen["released"] = max(seen["released"], nulls)
        seen["max_real"] = max(seen["max_real"], len(real))
    return tokens, seen


def test_chunk_blocks_return_to_the_pool_mid_request(model_dir: str, ref: Any) -> None:
    engine = LLMEngine.from_kwargs(model_dir, block_size=BLOCK, max_num_batched_tokens=16,
                                   enable_prefix_caching=False, **SMALL)
    prompt = PROMPTS[-1]
    tokens, seen = _run_watching_blocks(engine, "a", prompt, 40)
    assert tokens == ref(prompt, 40)[0]
    total = len(prompt) + 40
    assert seen["released"] >= (total - 1) // CHUNK * CHUNK // BLOCK - 2  # nearly every earlier chunk went back
    assert seen["max_real"] <= -(-(CHUNK - 1 + 16) // BLOCK) + 1
    assert _all_groups_empty(engine)


def test_prefix_hits_across_chunk_edges_give_the_same_tokens(model_dir: str, ref: Any) -> None:
    engine = LLMEngine.from_kwargs(model_dir, block_size=BLOCK, max_num_batched_tokens=16,
                                   enable_prefix_caching=True, **SMALL)
    base = _prompts(1, seed=3, lo=22, hi=23)[0]  # 22 tokens: chunks 0..7, 8..15 and 16..21
    shared = base[:20] + _prompts(1, seed=4, lo=5, hi=6)[0]  # the first 20 shared, then 5 of its own
    assert len(base) == 22 and shared[20:] != base[20:]
    first, seen_first = _run_watching_blocks(engine, "a", base, NEW)
    assert seen_first["cached"] == 0 and first == ref(base)[0]
    # The repeated prompt resumes at its last full block (20 of 22), the shared one at the end of the shared
    # 20 tokens: both past two chunk edges, both needing the chunk 16.. blocks the first run released or kept.
    again, seen_again = _run_watching_blocks(engine, "b", base, NEW)
    other, seen_other = _run_watching_blocks(engine, "c", shared, NEW)
    assert seen_again["cached"] == 20 and seen_other["cached"] == 20
    assert again == first and other == ref(shared)[0]
    assert _all_groups_empty(engine)


def test_only_backends_that_mask_by_chunk_are_selected(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.api import AttentionSelectionContext
    from pagedllm.api.model import Attention, ModelBuildContext
    from pagedllm.plugins.attention import flash_attn, flashinfer, flex, torch_sdpa, triton
    from pagedllm.selector import SelectionError

    # The engine tells the selector the model has chunked layers: a backend asked for by name that cannot mask
    # by chunk is refused with the reason (triton here, under its CPU interpreter so the device is no reason).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SelectionError, match="chunked local attention not supported"):
        LLM(model_dir, attention_backend="triton", block_size=BLOCK, **SMALL)

    # flash_attn's check stops at "no library installed" here; give it one (read from installed files only).
    fa3 = flash_attn.Variant("fa3", "flash_attn_interface", "flash-attn-3", "3.0", (9, 0), 9, 1)
    monkeypatch.setattr(flash_attn, "installed_variants", lambda: (fa3,))
    ctx = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16, chunked_local=True)
    assert torch_sdpa._check(ctx) == [] and flex._check(ctx) == []
    for check in (triton._check, flashinfer.check, flash_attn.check):
        reasons = check(ctx)
        assert any("chunked local attention not supported" in r for r in reasons), reasons
        plain = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)
        assert not any("chunked" in r for r in check(plain))

    class NoChunks:  # a backend that does not declare supports_chunked_local
        name = "no_chunks"

    build = ModelBuildContext(None, torch.float32, torch.device("cpu"), NoChunks, None, BLOCK)
    with pytest.raises(ValueError, match="'no_chunks' does not support chunked local attention"):
        Attention(build, 4, 16, 2, 0.25, attention_chunk_size=CHUNK, prefix="layer")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex: the CPU's way
@pytest.mark.parametrize("backend_name", ["torch", "flex"])
def test_backend_chunked_attention_equals_transformers_eager(backend_name: str) -> None:
    """Paged chunked attention -- a decode batch of unequal contexts, a fresh prompt, a chunk after a cached
    prefix -- against transformers' Llama 4 eager attention under its chunked causal mask over each request's
    whole K/V. Blocks before each request's current chunk are the null block in the table, and the null block
    holds garbage: a backend that read them would not match."""
    from types import SimpleNamespace

    from transformers.models.llama4.modeling_llama4 import eager_attention_forward

    from pagedllm.api.attention import AttentionLayerConfig
    from pagedllm.plugins.attention.flex.backend import FlexAttentionBackend
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.worker.input_prep import prepare_inputs

    backend: Any = TorchSDPABackend if backend_name == "torch" else FlexAttentionBackend
    heads, kv_heads, hs, bs, chunk = 4, 2, 16, 4, 8
    gen = torch.Generator().manual_seed(0)
    impl = backend.make_impl(AttentionLayerConfig(heads, hs, kv_heads, hs**-0.5, attention_chunk_size=chunk))
    # (cached before the step, new in the step): decodes at 19 and 8 (a chunk's first token), a fresh
    # 13-token prompt (two chunks), a 9-token chunk after 11 cached tokens (crossing the edge at 16).
    shape = [(19, 1), (8, 1), (0, 13), (11, 9)]
    lengths = [c + n for c, n in shape]
    q_all = [torch.randn(n, heads, hs, generator=gen) for n in lengths]
    k_all = [torch.randn(n, kv_heads, hs, generator=gen) for n in lengths]
    v_all = [torch.randn(n, kv_heads, hs, generator=gen) for n in lengths]
    blocks, next_block = [], 1  # block 0 is the null block
    for n in lengths:
        blocks.append(list(range(next_block, next_block + -(-n // bs))))
        next_block += len(blocks[-1])
    cache = torch.zeros(backend.kv_cache_shape(next_block, bs, kv_heads, hs))
    md_of = backend.build_metadata

    def step(rows: list[tuple[int, int, int]], num_decodes: int, tables: list[list[int]]) -> torch.Tensor:
        common = prepare_inputs([list(range(s + n)) for _, s, n in rows], [s for _, s, _ in rows],
                                [n for _, _, n in rows], [tables[i] for i, _, _ in rows], bs, torch.device("cpu"),
                                num_decodes).attn
        q, k, v = (torch.cat([t[i][s : s + n] for i, s, n in rows]) for t in (q_all, k_all, v_all))
        return impl.forward(q, k, v, cache, md_of(common))

    step([(i, 0, c) for i, (c, _) in enumerate(shape) if c], 0, blocks)  # the cached contexts
    # Release what the chunked manager would before the step (blocks wholly before the chunk of the first new
    # position) and fill the released blocks and the null block with garbage.
    tables = []
    for (cached, _), table in zip(shape, blocks, strict=True):
        skipped = cached // chunk * chunk // bs
        cache[:, table[:skipped]] = 1e4
        tables.append([0] * skipped + table[skipped:])
    cache[:, 0] = 1e4
    out = step([(i, c, n) for i, (c, n) in enumerate(shape)], 2, tables)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    row = 0
    for i, (cached, new) in enumerate(shape):
        total = cached + new
        q_pos, k_pos = torch.arange(cached, total)[:, None], torch.arange(total)[None, :]
        allowed = (k_pos <= q_pos) & (k_pos // chunk == q_pos // chunk)
        mask = torch.zeros(new, total).masked_fill(~allowed, float("-inf"))[None, None]
        expected, _ = eager_attention_forward(
            module, q_all[i][cached:].transpose(0, 1)[None], k_all[i].transpose(0, 1)[None],
            v_all[i].transpose(0, 1)[None], mask, scaling=hs**-0.5,
        )
        torch.testing.assert_close(out[row : row + new], expected[0], rtol=1e-5, atol=1e-5)
        row += new
