"""The flex attention backend: torch.nn.attention.flex_attention over the paged KV cache.

Cache layout, per layer: the torch reference's, kv_cache[0] = K, kv_cache[1] = V, each
[num_blocks, block_size, num_kv_heads, head] (so writes go through the same index_copy_ and the conformance
kit compares the caches slot for slot). Each step the impl (1) writes the new K/V rows at slot_mapping, then
(2) runs one flex_attention call for the whole packed batch -- decodes, fresh prompts and continued chunks
together -- under the block mask of paged_mask.py: the block tables say which pages each query group reads,
the mask mod makes it causal (plus sliding window / chunked local), the score mod soft-caps.

Eager or compiled (FlexOptions.compile): compiled runs read the cache in place (the physical page space;
the fused kernel visits only the listed pages); eager runs gather the step's pages first (the compact
space), because eager flex_attention scores every key row it is given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.nn.attention.flex_attention import flex_attention

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.flex import FlexOptions
from pagedllm.plugins.attention.flex.paged_mask import PagedMask, StepLayout, build_paged_mask, step_layout

ScoreMod = Any  # flex_attention's (score, b, h, q_idx, kv_idx) -> score


@dataclass
class FlexMetadata:
    """One step: the packed rows' layout and, built lazily by the first layer of each kind, their masks."""

    common: CommonAttentionMetadata
    layout: StepLayout
    compiled: bool
    q_block_size: int
    # (window, chunk) -> mask: Gemma-2's alternating layers need two per step, every layer of a kind reuses its.
    masks: dict[tuple[int | None, int | None], PagedMask] = field(default_factory=dict)


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention through torch.compile, made once per process on first use (inductor then keeps one
    kernel per shape it has seen; dynamic shapes after the first recompile)."""
    return torch.compile(flex_attention, fullgraph=True)


def _soft_cap(cap: float) -> ScoreMod:
    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


class FlexAttentionImpl:
    """One layer's kernel: write K/V, then one flex_attention call over the step's packed queries."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window = layer.sliding_window
        self.chunk_size = layer.attention_chunk_size  # chunked local attention (Llama 4), or None
        self.score_mod = _soft_cap(layer.logits_soft_cap) if layer.logits_soft_cap is not None else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        common = metadata.common
        num_tokens = common.num_actual_tokens
        two, num_blocks, block_size, kv_heads, head = kv_cache.shape
        k_flat = kv_cache[0].view(-1, kv_heads, head)
        v_flat = kv_cache[1].view(-1, kv_heads, head)
        # Rows past num_actual_tokens are padding: neither stored nor attended (their output rows stay 0).
        slots = common.slot_mapping[:num_tokens]
        k_flat.index_copy_(0, slots, key[:num_tokens].to(kv_cache.dtype))
        v_flat.index_copy_(0, slots, value[:num_tokens].to(kv_cache.dtype))
        out = torch.zeros_like(query)
        if num_tokens == 0:
            return out

        kind = (self.sliding_window, self.chunk_size)
        mask = metadata.masks.get(kind)
        if mask is None:
            mask = build_paged_mask(
                metadata.layout, num_blocks, self.sliding_window, self.chunk_size, metadata.q_block_size,
                compact=not metadata.compiled,
            )
            metadata.masks[kind] = mask
        if mask.pages is None:  # the physical space: the cache itself, read in place
            k, v = k_flat, v_flat
        else:  # the compact space: one gather of the step's pages for K and V together
            kv = kv_cache.view(two, num_blocks, -1).index_select(1, mask.pages)
            kv = kv.view(two, -1, kv_heads, head)
            k, v = kv[0], kv[1]
        q = query[:num_tokens].to(kv_cache.dtype).transpose(0, 1)[None]  # [1, heads, T, head]
        args = (q, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        kwargs: dict[str, Any] = dict(score_mod=self.score_mod, block_mask=mask.block_mask, scale=self.scale,
                                      enable_gqa=self.num_heads != self.num_kv_heads)
        if not metadata.compiled:
            got = flex_attention(*args, **kwargs)
        else:
            # NOTE: the kernel's tiles must divide the block mask's (one page per KV block, q_block_size
            # rows), as vLLM's direct-build path sets them; inductor's defaults (64-128) would not.
            block_m, block_n = mask.block_mask.BLOCK_SIZE
            kwargs["kernel_options"] = {"BLOCK_M": block_m, "BLOCK_N": block_n}
            try:
                got = _compiled_flex()(*args, **kwargs)
            except Exception as exc:
                # NOTE: torch 2.13's CPU inductor template fails to compile some shapes (a C++ codegen error,
                # e.g. head 16 on pages of 16); say which switch avoids it rather than a bare inductor trace.
                raise RuntimeError(
                    f"flex_attention failed to compile on {query.device.type} ({type(exc).__name__}); "
                    "set plugins.flex.compile: never to run it eagerly"
                ) from exc
        out[:num_tokens] = got[0].transpose(0, 1).to(out.dtype)
        return out


class FlexAttentionBackend:
    """flex_attention over the paged cache; sliding window, chunked local and soft-cap; CPU and CUDA."""

    name: ClassVar[str] = "flex"
    supports_chunked_local: ClassVar[bool] = True  # the mask mod's chunk term (paged_mask.py)
    options: ClassVar[FlexOptions] = FlexOptions()

    @classmethod
    def configure(cls, options: FlexOptions) -> type[FlexAttentionBackend]:
        """This backend bound to one engine's `plugins.flex` section: a subclass per engine."""
        return type(cls.__name__, (cls,), {"options": FlexOptions.model_validate(options)})

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The torch reference's layout: K and V stacked on a leading axis of 2, each in NHD block layout."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> FlexMetadata:
        """Where each packed query row sits (from the host copies); the masks follow at the first layer."""
        device = common.block_table.device
        mode = cls.options.compile
        compiled = mode == "always" or (mode == "auto" and device.type == "cuda")
        num_reqs = common.num_reqs
        layout = step_layout(
            common.query_start_loc_cpu[: num_reqs + 1].tolist(), common.seq_lens_cpu[:num_reqs].tolist(),
            common.block_table[:num_reqs], common.block_size,
        )
        return FlexMetadata(common, layout, compiled, cls.options.q_block_size)

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> FlexAttentionImpl:
        """One impl per attention layer."""
        return FlexAttentionImpl(layer)
