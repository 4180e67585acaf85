"""gpt-oss against transformers (float32, same weights, eager attention): greedy tokens and log-probs through
chunked prefill and mixed batches with prompts longer than the sliding window; sliding and full layers in two
KV-cache groups (the sliding one bounded, every group empty at the end); the learned sinks, the window, YaRN
and the experts each change transformers' tokens on these prompts, so the match is not an accident; only a
backend that applies sinks is selected; the torch backend's sinks equal transformers' eager attention at the
kernel level; tensor parallelism (tp=2, slow: a second process) gives the same tokens."""

from __future__ import annotations

import math
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
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager
from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager

WINDOW, BLOCK, VOCAB, NEW, TOP_N = 8, 4, 384, 24, 5
MAX_BLOCKS = math.ceil(WINDOW / BLOCK) + 1  # per request per sliding group while decoding
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
        intermediate_size=32,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        # YaRN over a 128-token original context (factor 512 / 128), so its ramp blends the head's dimensions.
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        # A wide init keeps the random model's logits peaked, so greedy argmax is not decided by rounding.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["GptOssForCausalLM"],
    )
    fields.update(overrides)
    return transformers.GptOssConfig(**fields)


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    import transformers

    path = tiny_root / "gpt_oss_window"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(_config()).float()
        with torch.no_grad():  # sinks of the size a trained model has (a few nats), so they move the softmax
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


@contextmanager
def _one_thread() -> Iterator[None]:
    """transformers' tiny forward passes run many times faster on one thread than on two busy cores."""
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

    return transformers.GptOssForCausalLM.from_pretrained(
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


PROMPTS = _prompts(4, seed=1)  # 5 to 29 tokens: most cross the window before decoding starts


def _managers(engine: LLMEngine) -> list[Any]:
    return list(engine.parts.kv_cache_manager.coordinator.managers)


def _all_groups_empty(engine: LLMEngine) -> bool:
    pool: BlockPool = engine.parts.kv_cache_manager.block_pool
    return (
        all(not m.req_to_blocks for m in _managers(engine))
        and pool.get_num_free_blocks() == pool.num_blocks - 1
        and engine.kv_cache_usage == 0.0
    )


def test_the_reference_depends_on_sinks_window_yarn_and_experts(model_dir: str, ref: Any) -> None:
    """Guard for the test below: each feature changes transformers' own tokens on these prompts."""
    import transformers

    prompts = sorted(PROMPTS, key=len)[-2:]  # the two longest: well past the window
    expected = [ref(p)[0] for p in prompts]
    no_sinks = _hf(model_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: plain softmax
    no_window = _hf(model_dir, sliding_window=4096)
    plain_rope = _hf(model_dir, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    one_expert = transformers.GptOssForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", num_experts_per_tok=1
    ).eval()
    for variant in (no_sinks, no_window, plain_rope, one_expert):
        assert any(_greedy(variant, p, NEW)[0] != e for p, e in zip(prompts, expected, strict=True))


def test_greedy_and_logprobs_match_transformers(model_dir: str, ref: Any) -> None:
    # Budget 16 < most prompts: prefills are chunked and share steps with other requests' decodes.
    llm = LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False,
              **SMALL)
    assert [type(m) for m in _managers(llm.engine)] == [SlidingWindowManager, FullAttentionManager]
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
    print(f"gpt-oss: max |Δ logprob| vs transformers over top-{TOP_N} x {NEW} steps = {max_delta:.2e}")
    assert max_delta < 1e-4
    assert _all_groups_empty(llm.engine)


def test_prefix_hits_and_the_bounded_sliding_group(model_dir: str, ref: Any) -> None:
    engine = LLMEngine.from_kwargs(model_dir, block_size=BLOCK, max_num_batched_tokens=64, **SMALL)
    sliding, full = _managers(engine)
    long_run = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # 4x the window
    prompt = PROMPTS[-1]
    finished: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    # The same prompt twice, one after the other: the second one starts from prefix-cache hits in both groups.
    for rid in ("a", "b"):
        engine.add_request(rid, {"prompt_token_ids": prompt}, long_run)
        requests = engine.core.scheduler.requests
        while engine.has_unfinished_requests():
            if rid in requests:
                cached[rid] = requests[rid].num_cached_tokens
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            request = requests.get(rid)
            if request is not None and request.num_computed_tokens > request.num_prompt_tokens:
                held = sum(1 for b in sliding.get_blocks(rid) if not b.is_null)
                assert held <= MAX_BLOCKS, f"{rid} holds {held} sliding-window blocks"
                assert len(full.get_blocks(rid)) == math.ceil(request.num_computed_tokens / BLOCK)
    assert cached["a"] == 0 and cached["b"] >= WINDOW  # "b" started from "a"'s blocks, past the window
    assert finished["a"] == finished["b"] == ref(prompt, 32)[0]
    assert _all_groups_empty(engine)


def test_only_a_backend_with_sinks_is_selected(model_dir: str) -> None:
    from pagedllm.api import AttentionSelectionContext
    from pagedllm.plugins.attention import flex, torch_sdpa, triton
    from pagedllm.selector import SelectionError

    ctx = AttentionSelectionContext("cpu", None, "float32", "auto", 16, BLOCK, sliding_window=True, sinks=True)
    assert torch_sdpa._check(ctx) == []
    assert any("sinks" in r for r in flex._check(ctx))
    assert any("sinks" in r for r in triton._check(ctx))
    with pytest.raises(SelectionError, match="sinks"):
        LLM(model_dir, attention_backend="flex", block_size=BLOCK, **SMALL)
    # A layer given sinks on a backend that does not declare them fails at construction, never runs without.
    from pagedllm.api.model import Attention, ModelBuildContext
    from pagedllm.plugins.attention.flex.backend import FlexAttentionBackend

    ctx = ModelBuildContext(None, torch.float32, torch.device("cpu"), FlexAttentionBackend, None, BLOCK)
    with pytest.raises(ValueError, match="'flex' does not support attention sinks"):
        Attention(ctx, 4, 16, 2, 0.25, sinks=torch.zeros(4), prefix="layer")


@pytest.mark.slow  # starts a rank-1 process
def test_tp2_greedy_equals_tp1_and_transformers(model_dir: str, ref: Any) -> None:
    """Heads, sinks and each expert's intermediate size split over two ranks; the all-reduced sums give the
    same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=2, block_size=BLOCK, **SMALL) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                             use_tqdm=False)]
    assert got == [ref(p)[0] for p in PROMPTS]


@pytest.mark.parametrize("window", [None, 4])
def test_torch_backend_sinks_equal_transformers_eager_attention(window: int | None) -> None:
    """The torch backend's paged attention with sinks, a decode batch of unequal contexts, a fresh prompt and a
    chunk after a cached prefix, against transformers' gpt-oss eager attention over each request's whole K/V."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from pagedllm.api.attention import AttentionLayerConfig
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.worker.input_prep import prepare_inputs

    heads, kv_heads, hs, bs = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    sinks = torch.randn(heads, generator=gen) * 2
    layer = AttentionLayerConfig(heads, hs, kv_heads, hs**-0.5, window, sinks=sinks)
    impl = TorchSDPABackend.make_impl(layer)
    # (cached before the step, new in the step): two decodes of unequal context, a fresh prompt, a chunk.
    shape = [(9, 1), (4, 1), (0, 7), (5, 6)]
    lengths = [c + n for c, n in shape]
    q_all = [torch.randn(n, heads, hs, generator=gen) for n in lengths]
    k_all = [torch.randn(n, kv_heads, hs, generator=gen) for n in lengths]
    v_all = [torch.randn(n, kv_heads, hs, generator=gen) for n in lengths]
    blocks, next_block = [], 1  # block 0 is the null block
    for n in lengths:
        blocks.append(list(range(next_block, next_block + -(-n // bs))))
        next_block += len(blocks[-1])
    cache = torch.zeros(TorchSDPABackend.kv_cache_shape(next_block, bs, kv_heads, hs))

    def step(rows: list[tuple[int, int, int]], num_decodes: int) -> torch.Tensor:
        md = prepare_inputs([list(range(s + n)) for _, s, n in rows], [s for _, s, _ in rows],
                            [n for _, _, n in rows], [blocks[i] for i, _, _ in rows], bs, torch.device("cpu"),
                            num_decodes).attn
        q, k, v = (torch.cat([t[i][s : s + n] for i, s, n in rows]) for t in (q_all, k_all, v_all))
        return impl.forward(q, k, v, cache, TorchSDPABackend.build_metadata(md))

    step([(i, 0, c) for i, (c, _) in enumerate(shape) if c], 0)  # the cached contexts
    out = step([(i, c, n) for i, (c, n) in enumerate(shape)], 2)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    row = 0
    for i, (cached, new) in enumerate(shape):
        total = cached + new
        q_pos, k_pos = torch.arange(cached, total)[:, None], torch.arange(total)[None, :]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        mask = torch.zeros(new, total).masked_fill(~allowed, float("-inf"))[None, None]
        expected, _ = eager_attention_forward(
            module, q_all[i][cached:].transpose(0, 1)[None], k_all[i].transpose(0, 1)[None],
            v_all[i].transpose(0, 1)[None], mask, scaling=hs**-0.5,
        )
        torch.testing.assert_close(out[row : row + new], expected[0], rtol=1e-5, atol=1e-5)
        row += new
