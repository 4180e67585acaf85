"""Gemma 3 (text only, `gemma3_text`): Gemma 2's layers with q/k norms and a RoPE per layer type.

Differences from Gemma 2 (gemma2_model.py), as transformers implements them:
- q and k pass through a per-head Gemma RMSNorm (weights [head_dim], shared by the heads) before RoPE;
- local (sliding) layers use their own RoPE base (`rope_local_base_freq`, 10k) and no scaling, global
  layers the global base (1M) and the checkpoint's rope scaling (linear x8 on the 4B and larger);
- attention scores are not soft-capped (the config field exists, transformers ignores it);
- the default pattern is 5 local : 1 global (`sliding_window_pattern` 6, or explicit `layer_types`), so the
  engine splits the local layers into five KV-cache groups the size of the global one (kv_cache/layout.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.api.model import GemmaRMSNorm, ModelBuildContext, RotaryEmbedding, head_dim_of, qk_norm_rope
from pagedllm.plugins.models.llama.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
)


def gemma3_rope(cfg: Any, head_dim: int, layer_type: str) -> RotaryEmbedding:
    """The RoPE of one layer type ('sliding_attention' or 'full_attention').

    transformers >= 5 keeps a rope dict per layer type in `rope_parameters`; older configs have rope_theta and
    rope_scaling for global layers and rope_local_base_freq for local ones.
    """
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        rope = dict(params[layer_type])
        theta = float(rope["rope_theta"])
    elif layer_type == "sliding_attention":
        rope, theta = {}, float(getattr(cfg, "rope_local_base_freq", None) or 10_000.0)
    else:
        rope, theta = dict(getattr(cfg, "rope_scaling", None) or {}), float(getattr(cfg, "rope_theta", 1e6))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_position = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
    return RotaryEmbedding(head_dim, head_dim, max_position, theta, None if rope_type == "default" else rope)


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention plus `q_norm` / `k_norm`, and no score soft-capping."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        super().__init__(ctx, rotary, layer_idx, prefix)
        eps = ctx.hf_config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, ctx.dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps, ctx.dtype)

    def attn_soft_cap(self, cfg: Any) -> float | None:
        return None  # transformers' Gemma3Attention never passes attn_logit_softcapping to the kernel

    def qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Both norms and the rotation in one launch on CUDA, in place in the qkv output.
        return qk_norm_rope(positions, q, k, self.q_norm, self.k_norm, self.rotary_emb, self.head_dim)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer with Gemma 3's attention."""

    def build_attention(
        self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> Gemma2Attention:
        return Gemma3Attention(ctx, rotary, layer_idx, prefix)


class Gemma3Model(Gemma2Model):
    """Gemma 2's model with one RoPE per layer type."""

    def layer_ropes(self, ctx: ModelBuildContext) -> list[RotaryEmbedding]:
        cfg = ctx.hf_config
        head_dim = head_dim_of(cfg)
        types = list(cfg.layer_types)
        ropes = {t: gemma3_rope(cfg, head_dim, t) for t in sorted(set(types))}
        return [ropes[t] for t in types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text checkpoints: Gemma 2's names plus self_attn.q_norm / k_norm."""

    decoder_layer_cls: ClassVar[type[Gemma2DecoderLayer]] = Gemma3DecoderLayer
    model_cls: ClassVar[type[Gemma2Model]] = Gemma3Model
