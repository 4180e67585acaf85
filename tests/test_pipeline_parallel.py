"""Pipeline parallelism on the CPU: pp=2 (and tp=2 x pp=2) over gloo against pp=1 and transformers.

The model is a tiny 3-layer Llama with tied embeddings, so the default split is uneven ([2, 1]: the
remainder goes to the stage before the last, as vLLM's get_pp_indices does) and the last stage must hold
the embedding for its tied LM head. References: transformers' float32 greedy loop on the same checkpoint
(tests/tiny_models.py) and our own pp=1 engine (seeded sampling, n > 1). A small token budget cuts the
prompts into chunks, so chunks of one prompt travel in successive micro-batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tiny_models import hf_greedy, tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.pp_partition import get_pp_indices, stage_layer_counts
from pagedllm.protocols.executor import WorkerDiedError

PROMPTS = [[1, 5, 9, 33, 70, 11, 250, 17, 3], [1, 100, 200, 300], [1, 42, 42, 42, 42, 42, 42, 7, 8, 9, 10],
           [1, 7], [1, 300, 301, 302, 303, 304, 305]]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7, n=2, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
# Small blocks and an 8-token budget: prompts span blocks and are prefilled in chunks over several steps.
ENGINE = dict(device="cpu", block_size=4, kv_cache_memory_gb=0.01, max_num_batched_tokens=8, num_threads=1)


def save_model(root: Path) -> str:
    path = root / "pp-llama3-tied"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = tiny_config("llama_tied")
        cfg.num_hidden_layers = 3
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


def run(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]], list[Any]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    seeded = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
    # Sampled and prompt logprobs, as {token: logprob} per position (computed on the last stage).
    logprobs = [([{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []],
                 [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs or []])
                for o in llm.generate(prompts, LOGPROBS, use_tqdm=False)]
    return greedy, seeded, logprobs


def assert_logprobs_close(got: list[Any], want: list[Any]) -> None:
    for (sampled, prompt), (sampled_ref, prompt_ref) in zip(got, want, strict=True):
        assert len(sampled) == 4 and len(prompt) == len(prompt_ref) > 1
        for d, ref in zip(sampled + prompt, sampled_ref + prompt_ref, strict=True):
            if ref is None:
                assert d is None
                continue
            assert d is not None and d.keys() == ref.keys()
            assert all(abs(d[t] - ref[t]) < 1e-4 for t in ref)


def watch_batches(llm: LLM) -> dict[str, Any]:
    """Record how many steps were in flight at once, and check that no batch holds a request whose token a
    batch in flight is still sampling (a prompt's next chunk may follow the one in flight: it needs no token)."""
    core = llm.engine.core
    queue = core._batches
    assert queue is not None, "pipeline parallelism should run with a batch queue"
    seen: dict[str, Any] = {"max_in_flight": 0, "launches": 0}
    sampling: dict[int, set[str]] = {}  # id(launched SchedulerOutput) -> the requests it samples
    launch = queue.executor.launch_model

    def recording_launch(so: Any) -> None:
        requests = core.scheduler.requests
        # After schedule(): a request samples in this step when its computed count reached its known tokens.
        sampling[id(so)] = {r for r in so.num_scheduled_tokens if r in requests
                            and requests[r].num_computed_tokens >= requests[r].num_tokens}
        busy = set().union(*(sampling.get(id(q), set()) for q in queue._queue))
        assert not busy & set(so.num_scheduled_tokens), (busy, so.num_scheduled_tokens)
        launch(so)
        seen["launches"] += 1
        seen["max_in_flight"] = max(seen["max_in_flight"], len(queue._queue) + 1)

    queue.executor.launch_model = recording_launch
    return seen


def test_split_follows_vllm_get_pp_indices() -> None:
    # vLLM's rule: floor per stage, the remainder one each on the stages before the last.
    assert stage_layer_counts(8, 2) == [4, 4]
    assert stage_layer_counts(3, 2) == [2, 1]
    assert stage_layer_counts(7, 3) == [2, 3, 2]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(5, r, 2, [1, 4]) for r in range(2)] == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match=r"parallel.pipeline_parallel_size 3 is more than the model's "
                                         r"num_hidden_layers 2"):
        stage_layer_counts(2, 3)
    with pytest.raises(ValueError, match=r"parallel.pp_layer_partition \[2, 2\]: .* sum to the model's "
                                         r"num_hidden_layers 5"):
        stage_layer_counts(5, 2, [2, 2])
    with pytest.raises(ValueError, match=r"parallel.pp_layer_partition \[5\] has 1 entries; "
                                         r"parallel.pipeline_parallel_size is 2"):
        stage_layer_counts(5, 2, [5])


def test_partition_from_the_environment_in_vllms_spelling() -> None:
    from pagedllm.config import ConfigError, EngineConfig

    cfg = EngineConfig.from_dict({}, env={"PAGEDLLM_PARALLEL__PP_LAYER_PARTITION": "2,1"})
    assert cfg.parallel.pp_layer_partition == [2, 1]
    with pytest.raises(ConfigError, match=r"parallel.pp_layer_partition: .*expected layer counts such as '3,5'"):
        EngineConfig.from_dict({}, env={"PAGEDLLM_PARALLEL__PP_LAYER_PARTITION": "2;1"})


def test_bad_pipeline_configs_fail_before_any_rank_starts(tiny_root: Path) -> None:
    model = save_model(tiny_root)
    with pytest.raises(ValueError, match=r"parallel.pipeline_parallel_size 4 is more than the model's "
                                         r"num_hidden_layers 3: every stage needs at least one decoder layer"):
        LLM(model, pipeline_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match=r"parallel.pp_layer_partition \[3, 1\]"):
        LLM(model, pipeline_parallel_size=2, pp_layer_partition=[3, 1], **ENGINE)
    with pytest.raises(ValueError, match=r"speculative.method 'ngram' with parallel.pipeline_parallel_size 2"):
        LLM(model, pipeline_parallel_size=2, speculative_config={"method": "ngram"}, **ENGINE)
    with pytest.raises(ValueError, match=r"scheduler.async_scheduling: cannot be true here: pipeline"):
        LLM(model, pipeline_parallel_size=2, async_scheduling=True, **ENGINE)


@pytest.mark.slow  # starts a second process
def test_pp2_equals_pp1_and_transformers(tiny_root: Path) -> None:
    model = save_model(tiny_root)
    expected = [tokens for tokens, _ in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    with LLM(model, **ENGINE) as llm1:
        greedy1, seeded1, logprobs1 = run(llm1)
        blocks1 = llm1.engine.parts.num_blocks
    with LLM(model, pipeline_parallel_size=2, **ENGINE) as llm2:
        parts = llm2.engine.parts
        assert parts.selections["executor"].winner.name == "multiproc"
        assert ("pipeline split [2, 1] (uneven: 3 layers over 2 stages, the remainder on the stages before the "
                "last); stage 0: layers 0-1, stage 1: layer 2") in parts.describe()
        # Rank 0 is stage 0: layers 0-1 and the embedding; layer 2, the final norm and the head are stage 1's.
        layers = parts.model.model.layers
        assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer", "LlamaDecoderLayer", "PPMissingLayer"]
        assert type(parts.model.lm_head).__name__ == "PPMissingLayer"
        assert not any("layers.2." in n or "lm_head" in n for n, _ in parts.model.named_parameters())
        assert len(parts.runner.kv_caches) == 2  # its own layers' caches only
        # The same budget holds 3/2 as many blocks of two layers as of three (min over the stages: stage 0's).
        assert parts.num_blocks == pytest.approx(blocks1 * 3 / 2, abs=1)
        seen = watch_batches(llm2)
        greedy2, seeded2, logprobs2 = run(llm2)
        # The last stage's process dies: the next step fails with the rank named, it does not hang.
        worker = llm2.engine.parts.executor._procs[0]
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+"):
            llm2.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    assert greedy1 == expected
    assert greedy2 == expected
    assert seeded2 == seeded1
    assert_logprobs_close(logprobs2, logprobs1)
    assert seen["max_in_flight"] == 2  # the two stages held different micro-batches at once
    assert all(len(c) == MAX_TOKENS for o in seeded2 for c in o)


@pytest.mark.slow  # starts a second process
def test_pp2_preemption_with_batches_in_flight_keeps_greedy_tokens(tiny_root: Path) -> None:
    """A pool too small for every request: running requests are preempted while other micro-batches are in
    flight, and recomputed; the tokens stay transformers' and every block comes back."""
    model = save_model(tiny_root)
    expected = [tokens for tokens, _ in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    small = {**ENGINE, "num_kv_blocks": 12, "admission_headroom_tokens": 0}  # admit eagerly: growth preempts
    with LLM(model, pipeline_parallel_size=2, enable_prefix_caching=False, **small) as llm:
        seen = watch_batches(llm)
        greedy = [list(o.outputs[0].token_ids)
                  for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
        preemptions = llm.engine.core.scheduler.get_stats().num_preemptions
        usage = llm.engine.core.scheduler.kv.usage
    assert greedy == expected
    assert preemptions > 0
    assert seen["max_in_flight"] == 2
    assert usage == 0


@pytest.mark.slow  # four gloo processes on the CPU (~1 min on 2 busy cores)
def test_tp2_pp2_equals_pp1(tiny_root: Path) -> None:
    model = save_model(tiny_root)
    expected = [tokens for tokens, _ in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    with LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.parts.runner.kv_caches[0].shape[-2] == 1  # 2 KV heads over 2 tensor-parallel ranks
        greedy = [list(o.outputs[0].token_ids)
                  for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    assert greedy == expected


@pytest.mark.slow  # starts a Ray cluster (~20 s)
def test_ray_pp2_equals_transformers(tiny_root: Path) -> None:
    ray = pytest.importorskip("ray")
    model = save_model(tiny_root)
    expected = [tokens for tokens, _ in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    ray.init(num_cpus=2, num_gpus=0, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        with LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
            assert llm.engine.parts.selections["executor"].winner.name == "ray"
            seen = watch_batches(llm)
            greedy = [list(o.outputs[0].token_ids)
                      for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    finally:
        ray.shutdown()
    assert greedy == expected
    assert seen["max_in_flight"] == 2
