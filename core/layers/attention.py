"""The model-side attention layer: shapes q/k/v into heads and hands them to the selected backend's kernel."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.protocols.attention import AttentionLayerConfig, KVGroupMetadata
from pagedllm.protocols.model import ModelBuildContext


class Attention(nn.Module):
    """Paged attention over one layer's KV cache. Head counts are this rank's (after tensor-parallel split).

    The layer holds no weights and no cache: the cache tensor arrives with every call, so the runner owns the
    memory and may re-allocate it (e.g. after profiling) without rebuilding the model.

    `kv_group_id` is the KV-cache group whose block table this layer reads; the engine sets it
    (kv_cache/layout.py `bind_kv_groups`) when the model's layers form several groups.
    """

    kv_group_id: int = 0

    def __init__(
        self,
        ctx: ModelBuildContext,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
        prefix: str = "",
    ) -> None:
        """`sinks`: this rank's [num_heads] learned sink logits (AttentionLayerConfig.sinks), or None.
        `attention_chunk_size`: chunked local attention's chunk (AttentionLayerConfig.attention_chunk_size)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{prefix}: {num_heads} query heads do not split into {num_kv_heads} KV groups")
        if sinks is not None:
            if tuple(sinks.shape) != (num_heads,):
                raise ValueError(f"{prefix}: sinks of shape {tuple(sinks.shape)}, expected ({num_heads},)")
            if not getattr(ctx.attn_backend, "supports_sinks", False):
                # Selection already refuses such a backend (AttentionSelectionContext.sinks); this catches a
                # model whose class did not declare its sinks, instead of attending without them.
                name = getattr(ctx.attn_backend, "name", ctx.attn_backend)
                raise ValueError(f"{prefix}: attention backend '{name}' does not support attention sinks")
        if attention_chunk_size is not None:
            if attention_chunk_size < 1:
                raise ValueError(f"{prefix}: attention_chunk_size must be >= 1, got {attention_chunk_size}")
            if sliding_window is not None:
                raise ValueError(f"{prefix}: a layer is chunked local or sliding window, not both")
            if not getattr(ctx.attn_backend, "supports_chunked_local", False):
                # As for sinks: selection refuses such a backend (AttentionSelectionContext.chunked_local); a
                # backend attending past the chunk would read blocks the KV manager has already released.
                name = getattr(ctx.attn_backend, "name", ctx.attn_backend)
                raise ValueError(f"{prefix}: attention backend '{name}' does not support chunked local attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_config = AttentionLayerConfig(
            num_heads=num_heads,
            head_size=head_size,
            num_kv_heads=num_kv_heads,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            cpu_ops=ctx.kernels.cpu_ops,
            sinks=sinks,
            attention_chunk_size=attention_chunk_size,
        )
        self.impl = ctx.attn_backend.make_impl(self.layer_config)
        self.prefix = prefix

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_size]
        key: torch.Tensor,  # [T, num_kv_heads * head_size]
        value: torch.Tensor,  # [T, num_kv_heads * head_size]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        """Write this step's K/V into the cache and attend over each request's context."""
        if isinstance(attn_metadata, KVGroupMetadata):  # a hybrid model: this layer's group's tables
            attn_metadata = attn_metadata.groups[self.kv_group_id]
        num_tokens = query.shape[0]
        out = self.impl.forward(
            query.reshape(num_tokens, self.num_heads, self.head_size),
            key.reshape(num_tokens, self.num_kv_heads, self.head_size),
            value.reshape(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        cfg = self.layer_config
        return (
            f"heads={cfg.num_heads}, kv_heads={cfg.num_kv_heads}, head_size={cfg.head_size}, "
            f"window={cfg.sliding_window}, chunk={cfg.attention_chunk_size}, sinks={cfg.sinks is not None}, "
            f"kv_group={self.kv_group_id}"
        )
