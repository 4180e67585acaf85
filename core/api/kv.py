"""pagedllm.api.kv: What a KV-manager plugin builds on: the block pool, its blocks, and the single-type manager base class; what a KV-connector plugin implements: the KVConnector protocol and its context.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.single_type_manager import SingleTypeKVCacheManagerBase, cdiv
from pagedllm.protocols.kv_connector import (
    KVConnector,
    KVConnectorAsyncLoad,
    KVConnectorContext,
    KVConnectorRequestHook,
)

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVConnector",
    "KVConnectorAsyncLoad",
    "KVConnectorContext",
    "KVConnectorRequestHook",
    "SingleTypeKVCacheManagerBase",
    "cdiv",
]
