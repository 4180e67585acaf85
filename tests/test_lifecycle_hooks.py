"""Lifecycle hooks reach a registered plugin: engine started/stopped, request finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import make_tiny_model

from pagedllm import SamplingParams, hookimpl
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.plugin_manager import PluginManager


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    @hookimpl
    def engine_started(self, engine: Any) -> None:
        self.events.append(("started", engine.max_model_len))

    @hookimpl
    def request_finished(self, output: Any) -> None:
        self.events.append(("finished", (output.request_id, output.outputs[0].finish_reason)))

    @hookimpl
    def engine_stopped(self, engine: Any) -> None:
        self.events.append(("stopped", None))


def test_lifecycle_hooks_fire_in_order(tiny_root: Path) -> None:
    pm = PluginManager()
    recorder = Recorder()
    pm.register(recorder, name="recorder", distribution="tests")
    engine = LLMEngine(EngineConfig(model=make_tiny_model("llama", tiny_root)), plugin_manager=pm)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        if ("finished", ("a", "length")) in recorder.events and engine.processor.requests.get("b"):
            engine.abort_request("b")
    engine.shutdown()
    engine.shutdown()  # idempotent
    names = [e[0] for e in recorder.events]
    assert names == ["started", "finished", "finished", "stopped"]
    assert ("finished", ("a", "length")) in recorder.events
    assert ("finished", ("b", "abort")) in recorder.events


class StepRecorder:
    def __init__(self) -> None:
        self.loaded: list[Any] = []
        self.added: list[str] = []
        self.steps: list[tuple[int, int, int]] = []

    @hookimpl
    def config_loaded(self, config: Any) -> None:
        self.loaded.append(config)

    @hookimpl
    def request_added(self, request: Any) -> None:
        self.added.append(request.request_id)

    @hookimpl
    def step_stats(self, stats: Any, num_scheduled_tokens: int, num_requests: int) -> None:
        self.steps.append((stats.num_steps, num_scheduled_tokens, num_requests))


def test_config_loaded_request_added_and_step_stats_fire(tiny_root: Path) -> None:
    pm = PluginManager()
    rec = StepRecorder()
    pm.register(rec, name="steps", distribution="tests")
    config = EngineConfig(model=make_tiny_model("llama", tiny_root), num_threads=1)
    engine = LLMEngine(config, plugin_manager=pm)
    assert rec.loaded == [config]
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert rec.added == ["a#0", "a#1"]
    assert [s[0] for s in rec.steps] == list(range(1, len(rec.steps) + 1))
    assert rec.steps[0][1:] == (6, 2) and rec.steps[-1][1:] == (2, 2)


def test_engine_freezes_its_startup_objects_until_shutdown(tiny_root: Path) -> None:
    """The engine moves what it built out of the cyclic GC (EngineCore NOTE) and gives it back at shutdown."""
    import gc

    gc.unfreeze()
    engine = LLMEngine(EngineConfig(model=make_tiny_model("llama", tiny_root), num_threads=1))
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the model, tokenizer-less config, plugin registries...
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_engine_raises_the_gc_threshold_until_shutdown(tiny_root: Path) -> None:
    """gc_threshold (EngineCore NOTE) holds while the engine runs; shutdown puts the process's back; null
    leaves it alone."""
    import gc

    before = gc.get_threshold()
    model = make_tiny_model("llama", tiny_root)
    engine = LLMEngine(EngineConfig(model=model, num_threads=1, gc_threshold=12_345))
    assert gc.get_threshold() == (12_345, *before[1:])
    engine.shutdown()
    assert gc.get_threshold() == before
    engine = LLMEngine(EngineConfig(model=model, num_threads=1, gc_threshold=None))
    assert gc.get_threshold() == before
    engine.shutdown()


def test_dropping_the_llm_shuts_the_engine_down(tiny_root: Path) -> None:
    """`del llm` gives the engine's frozen start-up objects back to the GC (and fires engine_stopped once):
    otherwise reference cycles among them -- a CUDA engine's graphs and weights -- would outlive it."""
    import gc

    from pagedllm import LLM

    gc.unfreeze()
    llm = LLM(make_tiny_model("llama", tiny_root), num_threads=1)
    engine = llm.engine
    assert gc.get_freeze_count() > 1000
    del llm
    assert engine._closed and gc.get_freeze_count() == 0


def test_shutdown_frees_the_model_while_the_llm_is_held(tiny_root: Path) -> None:
    """After shutdown() the weights and KV cache are collectable although the caller keeps the LLM (a CUDA
    engine's memory returns to the driver then), and a new request is refused with the reason."""
    import weakref

    import pytest

    from pagedllm import LLM

    llm = LLM(make_tiny_model("llama", tiny_root), num_threads=1)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    runner = llm.engine.core.runner
    weight = weakref.ref(next(llm.engine.parts.model.parameters()))
    cache = weakref.ref(runner.kv_caches[0])
    llm.shutdown()
    assert weight() is None and cache() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.add_request("again", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=1))
