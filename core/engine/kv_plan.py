"""The KV-cache plan of an engine build: specs grouped into a layout, a manager chosen per group, the cache
sized (forced, a CPU budget, or a GPU's free memory after a profiling step) and allocated.

The builder's fourth stage (builder.py): it runs after the model is built, because the model's layers say
what they keep (`kv_cache_specs()`), and before the scheduler, which hands out the blocks.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.communication import world_all_equal, world_min
from pagedllm.kv_cache.capacity import KVCapacity
from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig, KVCacheManager
from pagedllm.kv_cache.layout import KVCacheLayout, bind_kv_groups
from pagedllm.kv_cache.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import ComponentSpec, PluginKind
from pagedllm.selector import Selection, SelectionError, select
from pagedllm.worker.memory_profile import profile_activation_bytes

# The configured dtype names (`dtype`, `kv_cache.cache_dtype`) as torch dtypes.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVPlan:
    """The KV cache's layout, size and tensors, and the manager that hands out its blocks."""

    specs: list[KVCacheSpec]
    layout: KVCacheLayout
    num_blocks: int
    max_model_len: int
    capacity: KVCapacity
    kv_caches: list[torch.Tensor]
    manager: KVCacheManager
    selections: dict[str, Selection]

    @property
    def group_block_sizes(self) -> list[int]:
        return [g.spec.block_size for g in self.layout.groups]


def plan_kv_cache(
    config: EngineConfig, pm: PluginManager, model: Any, backend: Any, device: torch.device, trained: int | None
) -> KVPlan:
    specs, layout = _kv_layout(config, model)
    groups = layout.groups
    group_block_sizes = [g.spec.block_size for g in groups]
    selections: dict[str, Selection] = {}
    factories = []
    for i, group in enumerate(groups):
        key = f"kv_manager[{i}]" if len(groups) > 1 else "kv_manager"
        selections[key] = select_kv_manager(pm, group.spec)
        factories.append(selections[key].load())

    num_blocks = _num_blocks(config, layout, device, lambda: profile_activation_bytes(
        model, backend, specs, group_block_sizes[0], config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs, device, group_block_sizes,
        config.max_model_len or trained, compile_ahead=config.compile_ahead))
    _check_stage_layouts(config, layout)
    # Every rank must hold the same blocks (GPU memory may differ; a pipeline stage's layers differ too).
    num_blocks = world_min(num_blocks)
    model_max = config.max_model_len or trained or 2048
    # A request alone must always fit in the cache, or it could wait forever. Window-aware: a sliding-window
    # group holds a bounded number of blocks per request whatever its length (kv_cache/capacity.py).
    capacity = KVCapacity(layout, num_blocks, config.scheduler.max_num_batched_tokens)
    max_model_len = capacity.max_len(model_max)
    if config.max_model_len and config.max_model_len > max_model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {capacity.blocks_per_request(config.max_model_len)} "
            f"usable KV blocks but the cache has {num_blocks - 1}; raise kv_cache.memory_gb / num_blocks or "
            "lower max_model_len"
        )
    kv_caches = layout.allocate(backend, num_blocks, device)
    manager = KVCacheManager(
        KVCacheConfig(num_blocks, groups),
        factories,
        enable_caching=config.kv_cache.enable_prefix_caching,
        max_model_len=max_model_len,
    )
    return KVPlan(specs, layout, num_blocks, max_model_len, capacity, kv_caches, manager, selections)


def _check_stage_layouts(config: EngineConfig, layout: KVCacheLayout) -> None:
    """Pipeline stages hold different layers, but the scheduler's block tables (from stage 0's layout) address
    every stage's cache: each stage's KV groups must be the same (a model whose layer types change from one
    stage to the next is refused, with the groups named)."""
    if config.parallel.pipeline_parallel_size == 1:
        return
    groups = [repr(g.spec) for g in layout.groups]
    if not world_all_equal(groups):
        raise ValueError(
            f"parallel.pipeline_parallel_size {config.parallel.pipeline_parallel_size}: the stages' KV-cache "
            f"groups differ (this stage: {groups}); split at layers where the layer types match "
            "(parallel.pp_layer_partition)"
        )


def _kv_layout(config: EngineConfig, model: Any) -> tuple[list[KVCacheSpec], KVCacheLayout]:
    """The model's KV specs as configured, grouped into a layout the model's layers are bound to."""
    specs, layout = kv_layout(config, model)
    bind_kv_groups(model, layout)
    return specs, layout


def kv_layout(config: EngineConfig, model: Any) -> tuple[list[KVCacheSpec], KVCacheLayout]:
    """The model's KV specs as configured, grouped into a layout (not bound to the layers: the CPU sizing
    reads its bytes per block before the cache is planned, platform/cpu_sizing.py)."""
    specs: list[KVCacheSpec] = model.kv_cache_specs()
    if config.kv_cache.disable_sliding_window:
        specs = [_as_full_attention(s) for s in specs]
    # `kv_cache.cache_dtype`: the attention specs' dtype sizes the pages (fp8: half a 16-bit page, so twice
    # the blocks in the same memory) and the cache tensors; the chosen backend passed the same dtype in check().
    specs = [_with_cache_dtype(s, config.kv_cache.cache_dtype) for s in specs]
    # Groups by spec, split to equal sizes; groups of one page layout share cache tensors (kv_cache/layout.py).
    return specs, KVCacheLayout.plan(specs)


def select_kv_manager(pm: PluginManager, spec: KVCacheSpec) -> Selection:
    # Registries keyed by type: the most specific registered spec class wins (walk the MRO).
    candidates = pm.components(PluginKind.KV_MANAGER)
    for cls in type(spec).__mro__:
        matching: list[ComponentSpec] = [c for c in candidates if c.meta.get("spec_type") is cls]
        if matching:
            return select(pm, PluginKind.KV_MANAGER, spec, candidates=matching)
    raise SelectionError(f"no kv_manager plugin handles {type(spec).__name__}")


def _with_cache_dtype(spec: KVCacheSpec, cache_dtype: str) -> KVCacheSpec:
    """An attention spec stored in the configured KV-cache dtype ('auto' keeps the model's); others as they are."""
    if cache_dtype == "auto" or not isinstance(spec, AttentionSpec):
        return spec
    kv_dtype = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else DTYPES[cache_dtype]
    return dataclasses.replace(spec, dtype=kv_dtype)


def _as_full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """`kv_cache.disable_sliding_window`: keep every block (the attention layer still applies its window)."""
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
    return spec


def _num_blocks(
    config: EngineConfig, layout: KVCacheLayout, device: torch.device, profile: Callable[[], int] | None = None
) -> int:
    """KV blocks from the config: forced, a CPU budget in GiB, or what a GPU has left after a profiling run.

    GPU accounting (vLLM's): the engine may use utilization x total memory; of that, what is already in use
    (weights, CUDA context, other processes: total - free) and the peak activations of the largest step
    (`profile`, run once with a throw-away cache) are not available to the KV cache.
    """
    if config.kv_cache.num_blocks:
        return config.kv_cache.num_blocks
    bytes_per_block = layout.bytes_per_block  # one page per shared layer tensor
    if device.type == "cuda":
        activations = profile() if profile is not None else 0
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.kv_cache.gpu_memory_utilization - (total - free) - activations
        num_blocks = max(2, int(budget // bytes_per_block))
        block_size = layout.groups[0].spec.block_size
        print(
            f"pagedllm: KV cache {num_blocks} blocks = {num_blocks * block_size:,} tokens "
            f"({num_blocks * bytes_per_block / (1 << 30):.1f} GiB; in use {(total - free) / (1 << 30):.1f} GiB, "
            f"activation peak {activations / (1 << 30):.2f} GiB, of {total / (1 << 30):.1f} GiB)",
            file=sys.stderr,
            flush=True,
        )
        return num_blocks
    return max(2, int(config.kv_cache.memory_gb * (1 << 30) // bytes_per_block))
