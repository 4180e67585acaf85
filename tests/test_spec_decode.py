"""Speculative decoding changes speed, never tokens: greedy outputs with the `ngram` and `draft` proposers
are token-identical to outputs without speculation (mixed batches, chunked prefill, preemption, stops), and
rejected drafts leave no trace in the KV cache or the prefix cache. Metrics count what was verified."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.plugins.proposers.ngram.proposer import ngram_lookup
from pagedllm.selector import SelectionError

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: per-request attention calls are too small to split across threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tiny_root: Path) -> str:
    # The tiny random Qwen3 falls into repeating loops: n-gram drafts get accepted, often several in a row.
    return make_tiny_model("qwen3", tiny_root)


@pytest.fixture(scope="module")
def other_draft(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)  # same 384-token vocabulary, unrelated weights


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 384) for _ in range(rng.randrange(3, 40))] for _ in range(10)]


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _generate(llm: LLM, prompts: list[list[int]], params: Any = GREEDY) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(target: str, prompts: list[list[int]]) -> list[list[int]]:
    return _ids(_generate(LLM(target, block_size=4), prompts))


# -- greedy identity -----------------------------------------------------------------------------------------


def test_ngram_greedy_identical_mixed_chunked(target: str, prompts: list[list[int]],
                                              reference: list[list[int]]) -> None:
    # Budget 16: prompts are chunked, and decodes with drafts share steps with prefill chunks.
    llm = LLM(target, block_size=4, max_num_batched_tokens=16, speculative_method="ngram",
              num_speculative_tokens=3)
    assert _ids(_generate(llm, prompts)) == reference
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 50, "the loops of the tiny model must be found by the lookup"
    assert len(stats.spec_accepted_per_position) == 3 and min(stats.spec_accepted_per_position) > 0
    assert stats.num_steps < 2 * 48, "accepted drafts must save steps"
    assert llm.engine.kv_cache_usage == 0.0


def test_ngram_greedy_identical_under_preemption(target: str, prompts: list[list[int]],
                                                 reference: list[list[int]]) -> None:
    llm = LLM(target, block_size=4, num_kv_blocks=40, enable_prefix_caching=False, admission_headroom_tokens=0,
              speculative_method="ngram", num_speculative_tokens=4)
    assert _ids(_generate(llm, prompts)) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert llm.engine.kv_cache_usage == 0.0


@pytest.mark.parametrize("same", [True, False], ids=["draft=target", "draft=other"])
def test_draft_greedy_identical(target: str, other_draft: str, prompts: list[list[int]],
                                reference: list[list[int]], same: bool) -> None:
    # Budget 16: the draft catches up on long prompts in several chunked forwards too.
    llm = LLM(target, block_size=4, max_num_batched_tokens=16, speculative_method="draft",
              draft_model=target if same else other_draft, num_speculative_tokens=3)
    assert _ids(_generate(llm, prompts)) == reference
    stats = llm.engine.get_stats()
    if same:  # the target proposing for itself: every draft is what the target would say
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    else:
        assert stats.spec_acceptance_rate < 0.5
    assert llm.engine.kv_cache_usage == 0.0


def test_draft_greedy_identical_under_preemption(target: str, prompts: list[list[int]],
                                                 reference: list[list[int]]) -> None:
    llm = LLM(target, block_size=4, num_kv_blocks=40, admission_headroom_tokens=0, speculative_method="draft",
              draft_model=target, num_speculative_tokens=2)
    assert _ids(_generate(llm, prompts)) == reference
    assert llm.engine.get_stats().num_preemptions > 0


def test_stops_inside_accepted_drafts_truncate(target: str, prompts: list[list[int]],
                                              reference: list[list[int]]) -> None:
    # The target drafting for itself: nearly every token arrives inside an accepted run of drafts.
    llm = LLM(target, block_size=4, speculative_method="draft", draft_model=target, num_speculative_tokens=4)
    ref = reference[0]
    stop_at = 7
    stop_token = ref[stop_at]
    first = ref.index(stop_token)
    stopped = _generate(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                         stop_token_ids=[stop_token]))[0].outputs[0]
    assert stopped.token_ids == ref[: first + 1] and stopped.finish_reason == "stop"
    capped = _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert _ids(capped) == [r[:6] for r in reference]
    assert all(o.outputs[0].finish_reason == "length" for o in capped)


def test_logprobs_per_emitted_token(target: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = _generate(LLM(target, block_size=4), prompts[:3], params)
    spec = _generate(LLM(target, block_size=4, speculative_method="draft", draft_model=target), prompts[:3], params)
    for a, b in zip(plain, spec):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and cb.logprobs is not None and len(cb.logprobs) == len(cb.token_ids)
        for pa, pb in zip(ca.logprobs or [], cb.logprobs):
            assert pa.keys() == pb.keys()
            for tid in pa:
                assert pb[tid].logprob == pytest.approx(pa[tid].logprob, abs=1e-4)
                assert pb[tid].rank == pa[tid].rank


def test_seeded_sampling_is_reproducible_in_any_batch(target: str, prompts: list[list[int]]) -> None:
    """A seeded request draws its accept tests and tokens from its own generator: the same tokens alone or
    in a batch, run after run."""
    llm = LLM(target, block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=32, ignore_eos=True)
    alone = _ids(_generate(llm, prompts[:1], params))[0]
    batch = _generate(llm, prompts[:4], [params] + [SamplingParams(temperature=1.0, max_tokens=32)] * 3)
    assert _ids(batch)[0] == alone
    assert llm.engine.get_stats().spec_num_draft_tokens > 0


# -- no trace of rejected drafts -----------------------------------------------------------------------------


def _cached_blocks(llm: LLM) -> dict[tuple[int, bytes], int]:
    pool = llm.engine.parts.kv_cache_manager.block_pool
    return {key: next(iter(blocks)) for key, blocks in pool.cached_block_hash_to_block.items()}


def test_rejected_drafts_leave_no_trace(target: str, other_draft: str, prompts: list[list[int]]) -> None:
    """Same prompts with and without speculation: the prefix cache holds exactly the same hashes, and each
    hashed block holds the same K/V. An unrelated draft model gets most drafts rejected, so rejected
    tokens were written into these very blocks before being overwritten."""
    plain = LLM(target, block_size=4)
    _generate(plain, prompts)
    for kwargs in ({"speculative_method": "ngram", "num_speculative_tokens": 4},
                   {"speculative_method": "draft", "draft_model": other_draft, "num_speculative_tokens": 3}):
        spec = LLM(target, block_size=4, **kwargs)
        _generate(spec, prompts)
        stats = spec.engine.get_stats()
        assert stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens > 100  # plenty rejected
        want, got = _cached_blocks(plain), _cached_blocks(spec)
        # Every hash is one the plain run made too (a hash covering a draft token would be new). The spec
        # run may hash a few fewer tail blocks: its last step can emit several tokens the cache never sees.
        assert got.keys() <= want.keys() and len(got) >= 0.9 * len(want)
        for key, block in got.items():
            for cache_a, cache_b in zip(plain.engine.parts.runner.kv_caches, spec.engine.parts.runner.kv_caches):
                torch.testing.assert_close(cache_b[:, block], cache_a[:, want[key]], atol=1e-5, rtol=1e-4)


# -- configuration, selection, metrics -----------------------------------------------------------------------


def test_config_errors_name_the_key(target: str) -> None:
    with pytest.raises(ConfigError, match="speculative.prompt_lookup_max"):
        EngineConfig.from_dict({"speculative": {"method": "ngram", "prompt_lookup_min": 5}}, env={})
    with pytest.raises(ConfigError, match="speculative.num_speculative_tokens"):
        EngineConfig.from_dict({"speculative": {"num_speculative_tokens": 0}}, env={})
    with pytest.raises(SelectionError, match="speculative.draft_model is not set"):
        LLM(target, block_size=4, speculative_method="draft")
    with pytest.raises(SelectionError, match="no proposer named 'eagle'"):
        LLM(target, block_size=4, speculative_method="eagle")


def test_recurrent_state_models_refuse_speculation(tiny_root: Path) -> None:
    """A Mamba state has absorbed the rejected drafts; there is nothing to roll back, so it is refused."""
    import os

    import transformers

    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind

    if get_plugin_manager().get(PluginKind.MODEL, "MambaForCausalLM") is None:
        pytest.skip("no Mamba model plugin installed")
    path = tiny_root / "mamba_spec_refusal"
    if not (path / "config.json").exists():
        config = transformers.MambaConfig(vocab_size=384, hidden_size=32, state_size=8, num_hidden_layers=1,
                                          conv_kernel=4, expand=2, time_step_rank=8,
                                          architectures=["MambaForCausalLM"])
        os.makedirs(path, exist_ok=True)
        transformers.MambaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    with pytest.raises(ValueError, match="cannot be rolled back past rejected drafts"):
        LLM(str(path), block_size=4, num_kv_blocks=16, speculative_method="ngram")


def test_ngram_lookup() -> None:
    # Longest suffix first: "1 2 3" occurred before, followed by 4 5.
    assert ngram_lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 2) == [4, 5]
    # The most recent occurrence with k tokens after it wins.
    assert ngram_lookup([7, 1, 8, 8, 7, 1, 9, 9, 7], 1, 2, 2) == [1, 9]
    # None has k tokens after it: the earliest (longest continuation) is used.
    assert ngram_lookup([5, 6, 5], 1, 2, 4) == [6, 5]
    assert ngram_lookup([1, 2, 3], 1, 3, 3) == []
    assert ngram_lookup([3, 3, 3, 3], 2, 2, 2) == [3, 3]


def test_metrics_exported(target: str) -> None:
    pytest.importorskip("prometheus_client")
    from pagedllm.plugins.server.metrics import _EngineStatsCollector

    llm = LLM(target, block_size=4, speculative_method="draft", draft_model=target, num_speculative_tokens=2)
    _generate(llm, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))  # 1 + 3 + 3
    stats = llm.engine.get_stats()
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length == 2.0
    assert stats.spec_position_acceptance == [1.0, 1.0]

    class _Engine:
        model_name, healthy, restarts = "m", True, 0

    engine = _Engine()
    engine.stats = stats  # type: ignore[attr-defined]
    samples = {(s.name, s.labels.get("position")): s.value
               for metric in _EngineStatsCollector(engine).collect() for s in metric.samples}
    assert samples[("pagedllm:spec_decode_num_draft_tokens_total", None)] == stats.spec_num_draft_tokens
    assert samples[("pagedllm:spec_decode_num_accepted_tokens_per_pos_total", "1")] == stats.spec_num_drafts
    assert samples[("pagedllm:spec_decode_acceptance_rate", None)] == 1.0


def test_short_deterministic_proposals_are_padded_to_k() -> None:
    """An n-gram proposal shorter than k is padded with its last token, so verification steps stay uniform
    (k + 1 tokens per request: a CUDA graph on the GPU); a proposal with draft probabilities is left as is."""
    from pagedllm.spec_decode.proposer import Proposals
    from pagedllm.spec_decode.speculator import Speculator
    from pagedllm.worker.request_state import CachedRequestState

    class Fixed:
        def __init__(self, ids: list[int], probs: Any) -> None:
            self.ids, self.probs = ids, probs

        def propose(self, requests: list[Any]) -> Proposals:
            return Proposals([list(self.ids) for _ in requests], [self.probs for _ in requests])

        def remove_requests(self, req_ids: Any) -> None:
            pass

    def state(max_tokens: int) -> CachedRequestState:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return CachedRequestState("r", [1, 2, 3], [4], params, None, [[1]], 4)

    assert Speculator(Fixed([7, 8], None), 4, 64, 384).propose([state(32)]) == {"r": [7, 8, 8, 8]}
    # Near max_tokens fewer drafts are allowed (at most max_tokens - outputs - 1): padded only that far.
    assert Speculator(Fixed([7], None), 4, 64, 384).propose([state(4)]) == {"r": [7, 7]}
    q = torch.full((2, 384), 1 / 384)
    assert Speculator(Fixed([7, 8], q), 4, 64, 384).propose([state(32)]) == {"r": [7, 8]}
    assert Speculator(Fixed([], None), 4, 64, 384).propose([state(32)]) == {}
