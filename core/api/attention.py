"""pagedllm.api.attention: What an attention backend plugin builds on: the per-step metadata the runner hands it and the layer config.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.protocols.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    CommonAttentionMetadata,
    CpuDecodeAttentionImpl,
    CUDAGraphAttentionBackend,
    KVGroupMetadata,
)

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "CUDAGraphAttentionBackend",
    "CpuDecodeAttentionImpl",
    "AttentionLayerConfig",
    "CommonAttentionMetadata",
    "KVGroupMetadata",
]
