"""Bamba (Mamba-2 + attention) through the engine: two KV-cache groups (attention blocks that grow, one Mamba
state block per request); greedy tokens identical to transformers (float32, same weights) through chunked
prefill in mixed batches and real preemption under KV pressure; abort and preemption return every group's
usage to zero."""

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
from pagedllm.kv_cache.spec import FullAttentionSpec, MambaSpec
from pagedllm.plugins.kvmanagers.mamba.manager import MambaManager

VOCAB = 384
BLOCK = 4
NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _config() -> Any:
    import transformers

    return transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        architectures=["BambaForCausalLM"],
    )


@pytest.fixture(scope="module")
def model(tiny_root: Path) -> tuple[str, Any]:
    """(checkpoint folder, memoised transformers greedy reference)."""
    import transformers

    path = tiny_root / "bamba_random"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        hf = transformers.BambaForCausalLM(_config()).float().eval()
        with torch.no_grad():  # O(1) random weights: peaked logits, no greedy ties (see test_mamba_models)
            for name, param in hf.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif "embed" in name:
                    param.normal_(0.0, 1.0)
                elif name.endswith(("A_log", "dt_bias")):
                    param.normal_(-0.5, 0.5)
                else:
                    param.normal_(0.0, 0.15)
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path, safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(prompt: list[int], n: int = NEW) -> list[int]:
        # transformers' cached greedy decode (no EOS, so no logits processor touches the argmax);
        # test_reference_paths_agree checks it against full forwards.
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


def _group_usage(engine: LLMEngine) -> list[int]:
    """Real (non-null) blocks held per KV-cache group, over all requests."""
    managers = engine.parts.kv_cache_manager.coordinator.managers
    return [
        sum(1 for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null)  # type: ignore[attr-defined]
        for m in managers
    ]


def test_reference_paths_agree(model: tuple[str, Any]) -> None:
    """The cached reference equals transformers' plain full-forward argmax loop (tiny_models.hf_greedy_with)."""
    _, ref = model
    prompt = _prompts(1, seed=9)[0]
    assert ref(prompt) == hf_greedy_with(ref.model, prompt, NEW)[0]


def test_two_groups_and_chunked_mixed_batch_match_transformers(model: tuple[str, Any]) -> None:
    path, ref = model
    prompts = _prompts(5, seed=1)
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=5, num_kv_blocks=128,
              enable_prefix_caching=False)
    parts = llm.engine.parts
    managers = parts.kv_cache_manager.coordinator.managers
    specs = [m.spec for m in managers]  # type: ignore[attr-defined]
    assert sorted(type(s).__name__ for s in specs) == ["FullAttentionSpec", "MambaSpec"]
    assert any(isinstance(m, MambaManager) for m in managers)
    got = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert got == [ref(p) for p in prompts]
    assert _group_usage(llm.engine) == [0, 0] and llm.engine.kv_cache_usage == 0.0


def test_preemption_and_abort_free_every_group(model: tuple[str, Any]) -> None:
    path, ref = model
    prompts = _prompts(6, seed=2, lo=14, hi=22)
    # 30 blocks: each request holds 1 state block + up to 14 attention blocks at 22 + 32 tokens, so six do not
    # fit at once and the scheduler preempts (freeing both groups' blocks) and recomputes.
    tight = LLM(path, block_size=BLOCK, num_kv_blocks=30, max_num_seqs=6, max_num_batched_tokens=32,
                admission_headroom_tokens=0, enable_prefix_caching=False)
    got = _ids(tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert tight.engine.get_stats().num_preemptions > 0
    assert got == [ref(p) for p in prompts]
    assert _group_usage(tight.engine) == [0, 0] and tight.engine.kv_cache_usage == 0.0

    engine = LLMEngine.from_kwargs(path, block_size=BLOCK, max_num_batched_tokens=16, num_kv_blocks=128,
                                   enable_prefix_caching=False)
    managers = engine.parts.kv_cache_manager.coordinator.managers
    mamba_gid = next(i for i, m in enumerate(managers) if isinstance(m.spec, MambaSpec))  # type: ignore[attr-defined]
    attn_gid = 1 - mamba_gid
    assert isinstance(managers[attn_gid].spec, FullAttentionSpec)  # type: ignore[attr-defined]
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(8):
        engine.step()
    usage = _group_usage(engine)
    running = len(engine.core.scheduler.running)
    assert usage[mamba_gid] == running == 4 and usage[attn_gid] > running
    engine.abort_request(["1", "3"])
    assert _group_usage(engine)[mamba_gid] == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert _group_usage(engine) == [0, 0] and engine.kv_cache_usage == 0.0
