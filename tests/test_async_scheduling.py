"""Async scheduling (engine_core.py NOTE 1, model_runner.py NOTE 1) changes when the host works, never what
comes out: the same tokens as synchronous steps, exactly max_tokens of them, through chunked prefill,
preemption, aborts, stop tokens and seeded sampling with penalties; the KV cache drains to empty.

The pipelined path is device-agnostic (on the CPU the "in-flight" step has already finished), so every rule
it depends on -- placeholders in the scheduler, device-side filling of the next step's input ids, applying a
step's output one step late -- runs here exactly as on a GPU.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_root) -> str:
    return make_tiny_model("llama", tiny_root)


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(rng.randrange(lo, hi))]} for _ in range(n)]


def _run(model_dir: str, prompts: list[dict], params, **kwargs) -> tuple[list, LLM]:
    llm = LLM(model_dir, block_size=4, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False), llm


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_pipelined_equals_synchronous_with_chunked_prefill(model_dir: str) -> None:
    prompts = _prompts(1, 12, 3, 70)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 17) * 3]
    sync_out, _ = _run(model_dir, prompts, params, max_num_batched_tokens=32, async_scheduling=False)
    async_out, llm = _run(model_dir, prompts, params, max_num_batched_tokens=32, async_scheduling=True)
    assert llm.engine.core.async_scheduling
    assert _ids(async_out) == _ids(sync_out)
    assert [len(t) for t in _ids(async_out)] == [p.max_tokens for p in params]  # never a token past the end
    assert [o.outputs[0].finish_reason for o in async_out] == ["length"] * len(params)
    assert llm.engine.kv_cache_usage == 0.0
    assert not llm.engine.core.has_unfinished_requests()


def test_pipelined_stops_on_stop_tokens_like_synchronous(model_dir: str) -> None:
    prompts = _prompts(2, 8, 5, 30)
    probe, _ = _run(model_dir, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # Stop each request on the 4th token it generates: a stop discovered one step late must not leak.
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[o.outputs[0].token_ids[3]])
              for o in probe]
    sync_out, _ = _run(model_dir, prompts, params, async_scheduling=False)
    async_out, llm = _run(model_dir, prompts, params, async_scheduling=True)
    assert _ids(async_out) == _ids(sync_out)
    assert all(len(t) <= 4 for t in _ids(async_out))
    assert [o.outputs[0].finish_reason for o in async_out] == [o.outputs[0].finish_reason for o in sync_out]
    assert llm.engine.kv_cache_usage == 0.0


def test_pipelined_preemption_recomputes_identically(model_dir: str) -> None:
    prompts = _prompts(3, 8, 20, 40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy, _ = _run(model_dir, prompts, params, async_scheduling=False)
    tight, llm = _run(model_dir, prompts, params, num_kv_blocks=40, max_num_seqs=8, enable_prefix_caching=False,
                      async_scheduling=True, admission_headroom_tokens=0)
    assert _ids(tight) == _ids(roomy)
    assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.kv_cache_usage == 0.0


def test_pipelined_seeded_sampling_with_penalties_and_logprobs(model_dir: str) -> None:
    # Penalties read every output token so far: the runner must have written the in-flight token over its
    # placeholder before it samples the next one.
    prompts = _prompts(4, 6, 5, 25)
    params = [SamplingParams(temperature=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5, logprobs=2) for s in range(6)]
    sync_out, _ = _run(model_dir, prompts, params, async_scheduling=False)
    async_out, _ = _run(model_dir, prompts, params, async_scheduling=True)
    assert _ids(async_out) == _ids(sync_out)
    for a, b in zip(async_out, sync_out, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == 16
        assert [sorted(x) for x in la] == [sorted(x) for x in lb]


def test_pipelined_abort_in_flight_frees_everything(model_dir: str) -> None:
    llm = LLM(model_dir, block_size=4, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(5, 4, 10, 20)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["r0", "r2"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"r1": 40, "r3": 40}
    assert engine.kv_cache_usage == 0.0


def test_preempted_while_in_flight_recomputes_identically(model_dir: str) -> None:
    """Requests preempted between steps -- while the step in flight samples for them -- are not re-admitted
    before their token lands, and finish with the tokens of an undisturbed run."""
    prompts = _prompts(6, 5, 10, 25)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference, _ = _run(model_dir, prompts, params, async_scheduling=False)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=8, async_scheduling=True)
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finished: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in (3, 9, 14, 20) and scheduler.running:
            victim = scheduler.running.pop()
            scheduler.preempt(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.get_stats().num_preemptions == 4
    assert [finished[str(i)] for i in range(len(prompts))] == _ids(reference)
    assert engine.kv_cache_usage == 0.0


def test_async_scheduling_refused_with_speculation(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_SCHEDULER__ASYNC_SCHEDULING", raising=False)
    with pytest.raises(ValueError, match="scheduler.async_scheduling.*speculative"):
        LLM(model_dir, block_size=4, async_scheduling=True, speculative_method="ngram")
    # Left to itself (None) it is off on the CPU.
    assert not LLM(model_dir, block_size=4).engine.core.async_scheduling



def test_scheduler_plugins_opt_in(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler policy runs pipelined only if it declares supports_async_scheduling (the base class does
    not); asking for async scheduling with one that does not names the plugin."""
    from pagedllm.plugins.schedulers.fcfs.scheduler import FCFSScheduler
    from pagedllm.sched.base import SchedulerBase

    assert SchedulerBase.supports_async_scheduling is False and FCFSScheduler.supports_async_scheduling is True
    monkeypatch.setattr(FCFSScheduler, "supports_async_scheduling", False)
    with pytest.raises(ValueError, match="scheduler plugin 'fcfs' does not declare supports_async_scheduling"):
        LLM(model_dir, block_size=4, async_scheduling=True)


def test_refused_config_stops_remote_ranks(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting the engine core refuses after the executor started its remote ranks (here async scheduling
    with tp=2 and a scheduler that does not declare it) raises, and leaves no rank process behind."""
    import multiprocessing

    from pagedllm.plugins.schedulers.fcfs.scheduler import FCFSScheduler

    monkeypatch.setattr(FCFSScheduler, "supports_async_scheduling", False)  # rank 0's core alone decides
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="scheduler plugin 'fcfs' does not declare supports_async_scheduling"):
        LLM(model_dir, block_size=4, tensor_parallel_size=2, async_scheduling=True)
    assert set(multiprocessing.active_children()) == before
