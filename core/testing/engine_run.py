"""Greedy generation through a whole engine (LLMEngine) with the step sizes it scheduled recorded."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

# A small CPU engine: pages of 4 tokens and a 16-token budget, so paging, chunked prefill and mixed
# prefill/decode steps all happen on prompts of a few dozen tokens.
SMALL_ENGINE: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "kv_cache": {"block_size": 4, "num_blocks": 128},
    "scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
}


@dataclass
class EngineRun:
    """Greedy tokens per prompt (in prompt order) and, per step, (scheduled tokens, scheduled requests)."""

    tokens: list[list[int]]
    steps: list[tuple[int, int]] = field(default_factory=list)
    num_preemptions: int = 0
    last_stats: Any = None  # the scheduler's stats after the last step (SchedulerStats)


def merged(base: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`base` with `extra`'s keys on top, one level of sections deep ({"scheduler": {...}} merges)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


def run_greedy(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    config: Mapping[str, Any] | None = None,
    plugin_manager: PluginManager | None = None,
    extra_args: Mapping[str, Any] | None = None,
) -> EngineRun:
    """Generate `max_tokens` greedy tokens (EOS ignored) for each prompt with one engine, then shut it down.

    :param extra_args: every request's `SamplingParams.extra_args` (per-request logits-processor arguments).
    """
    from pagedllm import EngineConfig, LLMEngine, SamplingParams
    from pagedllm.testing.components import manager_or_default

    pm = manager_or_default(plugin_manager)
    engine_config = EngineConfig.from_dict(merged(SMALL_ENGINE, {**(config or {}), "model": model}))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            extra_args=dict(extra_args) if extra_args else None)
    run = EngineRun([])
    with _recording_steps(pm, run):
        engine = LLMEngine(engine_config, pm)
        try:
            order = {f"p{i}": i for i in range(len(prompts))}
            for rid, i in order.items():
                engine.add_request(rid, {"prompt_token_ids": list(prompts[i])}, params)
            results: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = list(out.outputs[0].token_ids)
            missing = sorted(set(order) - set(results))
            if missing:
                raise AssertionError(f"the engine stopped with requests unfinished: {missing}")
            run.tokens = [results[rid] for rid in order]
        finally:
            engine.shutdown()
    return run


_plugins = itertools.count()


@contextmanager
def _recording_steps(pm: PluginManager, run: EngineRun) -> Iterator[None]:
    """Record every engine step through the `step_stats` hook (the engine's own report of what it ran)."""
    from pagedllm import hookimpl

    class Recorder:
        @hookimpl
        def step_stats(self, stats: Any, num_scheduled_tokens: int, num_requests: int) -> None:
            run.steps.append((num_scheduled_tokens, num_requests))
            run.num_preemptions = max(run.num_preemptions, int(getattr(stats, "num_preemptions", 0)))
            run.last_stats = stats

    name = f"pagedllm-testing-steps-{next(_plugins)}"
    pm.register(Recorder(), name, distribution="pagedllm.testing")
    try:
        yield
    finally:
        pm.unregister(name)
