"""KV-cache specs: what one layer needs stored per token (or per request), keyed by type to pick a manager."""

from __future__ import annotations

import math
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

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, computing <= max_chunk per step.

        The default grows with the length (every token keeps its slot); layer types that drop old blocks
        or keep a constant state override it. Capacity planning (kv_cache/capacity.py) sums it over groups.
        """
        return -(-num_tokens // self.block_size)

    def own_cache_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        """The layer's cache tensor shape when the spec fixes it; None lets the attention backend choose."""
        return None

    def tokens_to_hold(self, num_tokens: int, num_encoder_tokens: int) -> int:
        """Slots a request of `num_tokens` (decoder) tokens and `num_encoder_tokens` encoder tokens holds here.

        The coordinator sizes each group's block list by this: most layer types hold the request's own
        tokens; cross-attention holds the encoder's output instead (CrossAttentionSpec).
        """
        return num_tokens


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
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention of an encoder-decoder model: the cache holds the encoder output's K/V.

    A request's blocks are sized from its encoder prompt (written once, by the step that runs the encoder),
    never from its decoder tokens, and they do not grow while it decodes. `max_encoder_len` (the encoder's
    position limit) bounds them for capacity planning. Shares a block's byte layout with the model's self-
    attention layers of the same shape (kv_cache/layout.py `page_layout`).
    """

    max_encoder_len: int = 0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The longest encoder prompt's blocks, whatever the decoder length."""
        return -(-self.max_encoder_len // self.block_size)

    def tokens_to_hold(self, num_tokens: int, num_encoder_tokens: int) -> int:
        return num_encoder_tokens


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last `sliding_window` tokens: older blocks can be released."""

    sliding_window: int = 0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The window bound: a step computing c tokens holds the window - 1 positions before them plus the c.

        Blocks wholly before position computed - window + 1 are released before each step allocates, so at
        most cdiv(window - 1 + c, block_size) + 1 blocks are held (ceil(window / block_size) + 1 when
        decoding, c = 1), never more than the length itself needs.
        """
        whole = -(-num_tokens // self.block_size)
        bound = -(-(self.sliding_window - 1 + max(max_chunk, 1)) // self.block_size) + 1
        return min(whole, bound)


@dataclass(frozen=True)
class SinkSlidingWindowSpec(SlidingWindowSpec):
    """StreamingLLM-style attention: the last `sliding_window` tokens plus the first `num_sink_tokens` tokens,
    which every later token attends to. The sink tokens' blocks stay while the request runs; the rest of the
    window's past is released. (Learned per-head sink *logits*, gpt-oss's, need no spec: they are weights.)"""

    num_sink_tokens: int = 0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The window bound plus the sink tokens' blocks, never more than the length itself needs."""
        whole = -(-num_tokens // self.block_size)
        sink_blocks = -(-self.num_sink_tokens // self.block_size)
        return min(whole, super().max_blocks_per_request(num_tokens, max_chunk) + sink_blocks)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Llama 4's chunked local attention: positions split into chunks of `attention_chunk_size` tokens, and a
    token attends only to the tokens of its own chunk up to itself. Blocks wholly before the current chunk
    can be released."""

    attention_chunk_size: int = 0

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The chunk bound: a step computing c tokens from position n holds the blocks from its chunk's start
        (at most chunk - 1 positions before n) to n + c, so at most cdiv(chunk - 1 + c, block_size) + 1 --
        never more than the length itself needs."""
        whole = -(-num_tokens // self.block_size)
        bound = -(-(self.attention_chunk_size - 1 + max(max_chunk, 1)) // self.block_size) + 1
        return min(whole, bound)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A Mamba layer's recurrent state: a constant size per request, however long the request grows.

    One block holds one request's whole state for this layer (conv state + SSM state), so a request holds
    exactly one real block per Mamba group. `block_size` is only the token granularity of the block table:
    the manager pads a request's list with the null block so the table stays index-aligned with positions
    (see plugins/kvmanagers/mamba/manager.py); padding costs no memory.
    """

    conv_state_shape: tuple[int, ...]  # (conv channels, conv kernel - 1)
    ssm_state_shape: tuple[int, ...]  # Mamba-1 (channels, state size); Mamba-2 (heads, head dim, state size)
    dtype: torch.dtype

    @property
    def conv_state_numel(self) -> int:
        return math.prod(self.conv_state_shape)

    @property
    def ssm_state_numel(self) -> int:
        return math.prod(self.ssm_state_shape)

    @property
    def page_size_bytes(self) -> int:
        return (self.conv_state_numel + self.ssm_state_numel) * _itemsize(self.dtype)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """One: the state block. The null-block padding of the list holds no memory."""
        return 1

    def own_cache_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        # One row per block: the conv state then the SSM state, flattened (the layer views the two apart).
        return (num_blocks, self.conv_state_numel + self.ssm_state_numel)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
