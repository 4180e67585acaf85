"""KV-cache specs: what one layer needs stored per token (or per request), keyed by type to pick a manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # registration modules import this; `pagedllm plugins` must not pull in torch
    import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec. `block_size` tokens share one block; `page_size_bytes` is one block's memory."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # K and V, each [block_size, num_kv_heads, head_size].
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _itemsize(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: the cache grows one slot per token."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last `sliding_window` tokens: older blocks can be released."""

    sliding_window: int = 0


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
