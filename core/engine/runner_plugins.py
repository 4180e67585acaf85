"""The plugins a model runner is built with: the config's logits processors (in the runner's sampler) and,
when `speculative.method` is set, the speculator around the configured proposer.

The builder makes them once per engine, on rank 0 only, and passes them to the ModelRunner's constructor:
nothing is handed to a runner after it is built. Remote tensor-parallel ranks get neither (their sampled
tokens are replaced by rank 0's, tp_worker.py NOTE 1; speculation runs on one rank).

NOTE: the proposer is built after the target's KV cache is allocated: a draft model's weights and cache must
fit in what the target left (on a GPU, lower kv_cache.gpu_memory_utilization to make room).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig, plugin_section
from pagedllm.kv_cache.spec import AttentionSpec, KVCacheSpec
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.sample.logits_processor import LogitsProcessor, LogitsProcessorContext
from pagedllm.sample.sampler import Sampler
from pagedllm.selector import Selection, select
from pagedllm.spec_decode.proposer import ProposerContext, build_proposer
from pagedllm.spec_decode.speculator import Speculator


@dataclass(frozen=True)
class TargetFacts:
    """What the runner's plugins are built against: the target engine, once its KV cache is allocated."""

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_specs: tuple[KVCacheSpec, ...]  # one per KV-cache group


@dataclass(frozen=True)
class RunnerPlugins:
    sampler: Sampler
    speculator: Speculator | None = None
    selections: dict[str, Selection] = field(default_factory=dict)  # logits_processor[name]..., proposer

    @property
    def logits_processors(self) -> list[LogitsProcessor]:
        return list(self.sampler.logits_processors)


def build_runner_plugins(
    config: EngineConfig, pm: PluginManager, target: TargetFacts, plugin_sections: Mapping[str, Any]
) -> RunnerPlugins:
    """:param plugin_sections: the config's validated `plugins.*` sections (validate_plugin_sections)."""
    processors, selections = build_logits_processors(config, pm, target, plugin_sections)
    speculator = None
    if config.speculative.method is not None:
        speculator, selections["proposer"] = build_speculator(config, pm, target)
    return RunnerPlugins(Sampler(processors), speculator, selections)


def build_logits_processors(
    config: EngineConfig, pm: PluginManager, target: TargetFacts, plugin_sections: Mapping[str, Any]
) -> tuple[list[LogitsProcessor], dict[str, Selection]]:
    """The config's `logits_processors`, in order, each with its validated `plugins.<name>` section."""
    if not config.logits_processors:
        return [], {}
    models = pm.config_models()
    processors: list[LogitsProcessor] = []
    selections: dict[str, Selection] = {}
    for name in config.logits_processors:
        # Named in the config = requested explicitly: unknown, broken or incompatible fails loudly.
        selection = selections[f"logits_processor[{name}]"] = select(
            pm, PluginKind.LOGITS_PROCESSOR, None, requested=name
        )
        ctx = LogitsProcessorContext(name, plugin_section(plugin_sections, name, models), target.vocab_size, target.device)
        processors.append(selection.load()(ctx))
    return processors, selections


def build_speculator(config: EngineConfig, pm: PluginManager, target: TargetFacts) -> tuple[Speculator, Selection]:
    """The configured proposer (module NOTE: after the target's KV cache), wrapped for the runner."""
    spec = config.speculative
    # Rejected drafts are undone by rolling num_computed_tokens back over KV slots; a recurrent state
    # (Mamba) has already absorbed them and cannot be rolled back.
    kinds = {type(s).__name__ for s in target.kv_specs if not isinstance(s, AttentionSpec)}
    if kinds:
        raise ValueError(
            f"speculative.method {spec.method!r}: this model has {', '.join(sorted(kinds))} layers, whose "
            "state cannot be rolled back past rejected drafts; speculative decoding needs attention layers"
        )
    ctx = ProposerContext(
        config=spec,
        engine_config=config,
        plugin_manager=pm,
        device=target.device,
        dtype=target.dtype,
        vocab_size=target.vocab_size,
        max_model_len=target.max_model_len,
        block_size=target.block_size,
        num_kv_blocks=target.num_kv_blocks,
    )
    proposer, selection = build_proposer(ctx)
    return Speculator(proposer, spec.num_speculative_tokens, target.max_model_len, target.vocab_size), selection
