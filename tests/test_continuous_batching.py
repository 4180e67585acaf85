"""Continuous batching is invisible in the results: chunked prefill, prefix sharing, preemption and aborts
never change a request's greedy tokens, and the KV cache always drains back to empty."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_root) -> str:
    return make_tiny_model("llama", tiny_root)


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _alone(model_dir: str, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    llm = LLM(model_dir, block_size=4, enable_prefix_caching=False, max_num_seqs=1)
    return [_ids(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0] for p in prompts]


def test_shared_prefix_chunked_prefill_matches_alone(model_dir: str) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 384) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))] for _ in range(16)]
    alone = _alone(model_dir, prompts)

    # Budget 32 < most prompts: every prefill is chunked, and decodes share steps with prefills.
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, max_num_seqs=16)
    together = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    assert together == alone
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0, "requests sharing a 40-token prefix must hit the prefix cache"
    assert llm.engine.kv_cache_usage == 0.0


def test_kv_pressure_preempts_and_recomputes_identically(model_dir: str) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = _ids(LLM(model_dir, block_size=4).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))

    # 40 blocks x 4 tokens: ~2 requests fit at once, so running requests must be preempted as they grow.
    tight = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_seqs=8, enable_prefix_caching=False,
                admission_headroom_tokens=0)  # vLLM's rule: admit while blocks are free, preempt later
    got = _ids(tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert got == roomy
    assert tight.engine.get_stats().num_preemptions > 0
    assert tight.engine.kv_cache_usage == 0.0


def test_admission_headroom_admits_what_can_grow(model_dir: str) -> None:
    """The same pressure with the default headroom (scheduler NOTE 2): a request is admitted only while every
    running one can still grow to its max_tokens (24 here, under the headroom), so nothing is preempted, the
    tokens are the same, and more than one request still runs at once."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = _ids(LLM(model_dir, block_size=4).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    llm = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    most_running, finished = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = list(out.outputs[0].token_ids)
        most_running = max(most_running, engine.get_stats().num_running)
    assert [finished[i] for i in range(len(prompts))] == roomy
    assert engine.get_stats().num_preemptions == 0
    assert most_running >= 2
    assert engine.kv_cache_usage == 0.0


def test_aborts_free_everything_and_spare_the_rest(model_dir: str) -> None:
    engine = LLMEngine.from_kwargs(model_dir, block_size=4, max_num_batched_tokens=64)
    rng = random.Random(3)
    prompts = {str(i): [rng.randrange(3, 384) for _ in range(30)] for i in range(6)}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_usage > 0
    engine.abort_request(["0", "2", "4"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"1", "3", "5"}
    assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    assert engine.kv_cache_usage == 0.0

    # Abort everything mid-flight, including requests still waiting.
    for rid, p in prompts.items():
        engine.add_request("again" + rid, {"prompt_token_ids": p}, GREEDY)
    engine.step()
    engine.abort_request(["again" + rid for rid in prompts])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_usage == 0.0


def test_too_long_prompt_raises_before_anything_runs(model_dir: str) -> None:
    # vLLM's LLM.generate raises ValueError for a prompt that can never fit; nothing of the batch is left queued.
    llm = LLM(model_dir, block_size=4, max_model_len=64)
    prompts = [[5] * 10, [6] * 100, [7] * 12]
    with pytest.raises(ValueError, match="maximum context length is 64 tokens.*100 tokens"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in (prompts[0], prompts[2])], GREEDY, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 16 for o in outs)
    assert llm.engine.kv_cache_usage == 0.0


def test_n_samples_share_prompt_blocks(model_dir: str) -> None:
    llm = LLM(model_dir, block_size=4)
    prompt = {"prompt_token_ids": list(range(10, 50))}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds per sample"
    assert llm.engine.get_stats().prefix_cache_hits > 0
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
