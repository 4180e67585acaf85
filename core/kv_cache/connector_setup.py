"""The engine's KV connector, when `kv_transfer.kv_connector` names one (or several, stacked:
connector_stack.py): selected, built and wired in.

Off by default, and then nothing here runs: the scheduler, the block pool and the runner each keep a None
and check it once per step (per eviction, for the pool). A connector is only used when asked for by name,
validated strictly by the selector against the engine's facts (KVConnectorCheckContext); its reasons are the
error. Wiring: the block pool tells it every eviction, the scheduler asks it at admission and hands its plan
to the runner in each SchedulerOutput, the runner runs the plan on the cache tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pagedllm.config import EngineConfig, plugin_section
from pagedllm.kv_cache.connector_stack import ConnectorStack
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.kv_connector import KVConnectorContext
from pagedllm.selection_context import KVConnectorCheckContext
from pagedllm.selector import Selection, select


def build_kv_connector(
    config: EngineConfig,
    pm: PluginManager,
    plugin_sections: Mapping[str, Any],
    *,
    model: str,
    kv_manager: Any,
    scheduler: Any,
    runner: Any,
    kv_caches: list[torch.Tensor],
    block_axis: int,
    device: torch.device,
) -> dict[str, Selection]:
    """Select and build the configured connector(s) and wire them into `kv_manager`, `scheduler` and `runner`.

    Returns the selections (for `Selection.explain()`): `kv_connector`, or `kv_connector[i]` for each of a
    list (connector_stack.py), or none when the config names none.
    """
    configured = config.kv_transfer.kv_connector
    if not configured:
        return {}
    names = [configured] if isinstance(configured, str) else list(configured)
    parallel = config.parallel
    context = KVConnectorCheckContext(
        device=device.type,
        num_kv_groups=kv_manager.num_groups,
        kv_spec_types=tuple(type(group.spec).__name__ for group in kv_manager.config.groups),
        world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        enable_prefix_caching=kv_manager.enable_caching,
    )
    selections: dict[str, Selection] = {}
    connectors = []
    for i, name in enumerate(names):
        key = "kv_connector" if len(names) == 1 else f"kv_connector[{i}]"
        selection = select(pm, PluginKind.KV_CONNECTOR, context, requested=name,
                           requested_by=f"config kv_transfer.{key}")
        selections[key] = selection
        connectors.append(selection.load()(KVConnectorContext(
            model=model,
            block_size=kv_manager.block_size,
            num_blocks=kv_manager.block_pool.num_blocks,
            block_axis=block_axis,
            device=device.type,
            plugin_config=plugin_section(plugin_sections, name, pm.config_models()),
        )))
    connector = connectors[0] if len(connectors) == 1 else ConnectorStack(connectors)
    connector.register_kv_caches(kv_caches)
    on_evict = connector.on_device_evict
    # One KV-cache group (the check context says so to the connector): the group id is always 0.
    kv_manager.block_pool.evict_listener = lambda block_hash, block_id, _group: on_evict(block_hash, block_id)
    scheduler.kv_connector = connector
    runner.kv_connector = connector
    return selections


def block_axis_of(backend: Any) -> int:
    """The axis of the backend's cache tensors that indexes blocks (where two block counts' shapes differ)."""
    one, two = backend.kv_cache_shape(2, 16, 1, 8), backend.kv_cache_shape(3, 16, 1, 8)
    axes = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(axes) != 1:
        raise ValueError(f"cannot find the block axis of {type(backend).__name__}.kv_cache_shape: {one} vs {two}")
    return axes[0]
