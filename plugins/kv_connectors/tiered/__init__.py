"""Registers the `tiered` KV connector: a host-memory tier and an optional local-disk tier under the prefix cache.

Light module: no torch import here (connector.py imports it when the engine builds the connector). Used only
when named (`kv_transfer: {kv_connector: tiered}`), with its options in `plugins.tiered`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import KVConnectorCheckContext, RegisterKVConnector, hookimpl

# 1.5: a prefix hit may load asynchronously (get_num_new_matched_tokens answers (tokens, load_async)).
PAGEDLLM_PLUGIN_API = ">=1.5,<2"


class TieredOptions(BaseModel):
    """`plugins.tiered`: the tiers' sizes and the disk tier's directory (validated: a typo is an error)."""

    model_config = ConfigDict(extra="forbid")

    host_gb: float = Field(
        1.0, gt=0, description="host-memory tier capacity in GiB (pinned on CUDA); blocks the device pool evicts "
        "land here, least recently used out first (down to the disk tier when there is one)",
    )
    disk_dir: str | None = Field(
        None, description="local-disk tier: a directory for one file per block (created if missing); a file "
        "survives the engine, so a later engine of the same model and cache layout reuses it; None = no disk tier",
    )
    disk_gb: float = Field(10.0, gt=0, description="disk tier size cap in GiB (least recently used files out)")
    disk_write_queue_blocks: int = Field(
        256, ge=1, description="disk tier write-behind bound: blocks waiting in host memory for their file; past "
        "it a demoted block is dropped (counted in disk_writes_dropped) rather than stalling a step",
    )


def _load() -> Any:
    from pagedllm.plugins.kv_connectors.tiered.connector import TieredConnector

    return TieredConnector


def _check(ctx: KVConnectorCheckContext) -> list[str]:
    reasons = []
    if not ctx.enable_prefix_caching:
        reasons.append("needs prefix caching (kv_cache.enable_prefix_caching): blocks are keyed by their hashes")
    if ctx.num_kv_groups != 1:
        reasons.append(f"one KV-cache group only (this model has {ctx.num_kv_groups}: mixed layer types)")
    if ctx.num_kv_groups == 1 and ctx.kv_spec_types != ("FullAttentionSpec",):
        # A sliding window's or a Mamba state's blocks are not a prefix's KV block by block.
        reasons.append(f"full attention only (this model's KV cache is {ctx.kv_spec_types[0]})")
    if ctx.world_size != 1:
        reasons.append(f"one rank only for now (tensor x pipeline parallel = {ctx.world_size})")
    return reasons


@hookimpl
def register_kv_connectors(register: RegisterKVConnector) -> None:
    register(
        "tiered", _load, check=_check, config_model=TieredOptions, explicit_only=True,
        description="host-memory (LRU) and local-disk tiers for blocks evicted from the device prefix cache",
    )
