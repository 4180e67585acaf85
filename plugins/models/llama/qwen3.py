"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on q and k before RoPE, and an explicit head_dim."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedllm.api.model import LlamaAttention, ModelBuildContext, RMSNorm, RotaryEmbedding, qk_norm_rope
from pagedllm.plugins.models.llama.model import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Adds `q_norm` / `k_norm` ([head_dim] weights shared by all heads) applied to each head before RoPE."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        bias = bool(getattr(ctx.hf_config, "attention_bias", False))
        super().__init__(ctx, rotary, layer_idx, prefix, qkv_bias=bias, o_bias=bias)
        eps = ctx.hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, ctx.dtype)
        self.k_norm = RMSNorm(self.head_dim, eps, ctx.dtype)

    def qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Both norms and the rotation in one launch on CUDA, in place in the qkv output.
        return qk_norm_rope(positions, q, k, self.q_norm, self.k_norm, self.rotary_emb, self.head_dim)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Qwen3's attention."""

    def build_attention(
        self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> LlamaAttention:
        return Qwen3Attention(ctx, rotary, layer_idx, prefix)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 checkpoints use Llama's names plus self_attn.q_norm / k_norm, loaded as plain parameters."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer
