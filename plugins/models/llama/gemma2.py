"""Gemma 2: local (sliding-window) and global attention layers interleaved, soft-capped, sandwich-normed.

Layer i (type local or global, from `config.layer_types`):
    h = x + post_attention_norm(o_proj(attn(rope(q), rope(k), v)))   with q, k, v = qkv_proj(input_norm(x))
    y = h + post_feedforward_norm(down_proj(gelu_tanh(gate) * up))   with gate, up = gate_up(pre_ff_norm(h))
Every norm is Gemma's RMSNorm, x * (1 + w) in float32. The embedding is scaled by sqrt(hidden_size) (in the
model dtype, as transformers does), attention scores by query_pre_attn_scalar^-0.5 and capped as
cap * tanh(s / cap) (attn_logit_softcapping), and the final logits likewise (final_logit_softcapping).

Local layers get a SlidingWindowSpec and global ones a FullAttentionSpec, so the engine puts them in two
KV-cache groups: local layers keep only their window's blocks while global ones keep everything.
Gemma 3 (gemma3_model.py) reuses these pieces with q/k norms and a rope per layer type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.api.model import (
    GeluTanhAndMul,
    GemmaRMSNorm,
    LlamaAttention,
    MergedColumnParallelLinear,
    ModelBuildContext,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    head_dim_of,
)
from pagedllm.plugins.models.llama.model import LlamaForCausalLM

_DERIVED_BUFFERS = ("rotary_emb.", "embed_scale")


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: gelu_tanh(gate) * up, gate and up fused into one column-parallel matmul."""

    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{prefix}: hidden_activation '{act}' not supported (only gelu_pytorch_tanh)")
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            ctx, cfg.hidden_size, [size, size], bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            ctx, size, cfg.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma's score scale (query_pre_attn_scalar) and soft-capped scores; windowed on
    local layers."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        cfg = ctx.hf_config
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(
            ctx, rotary, layer_idx, prefix, qkv_bias=bias, o_bias=bias,
            scale=float(cfg.query_pre_attn_scalar) ** -0.5, logits_soft_cap=self.attn_soft_cap(cfg),
        )

    def attn_soft_cap(self, cfg: Any) -> float | None:
        """Gemma 2 caps attention scores; Gemma 3 has the field but transformers never applies it."""
        cap = getattr(cfg, "attn_logit_softcapping", None)
        return float(cap) if cap else None


class Gemma2DecoderLayer(nn.Module):
    """Sandwich norms: each sub-block's input and output are normed before the residual add."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = self.build_attention(ctx, rotary, layer_idx, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(ctx, f"{prefix}.mlp")
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)

    def build_attention(
        self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> Gemma2Attention:
        """The layer's attention block; Gemma 3 overrides this."""
        return Gemma2Attention(ctx, rotary, layer_idx, prefix)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual before it): the caller's next norm adds them (fused add + norm)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma2Model(nn.Module):
    """Scaled embedding, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, ctx: ModelBuildContext, layer_cls: type[Gemma2DecoderLayer]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention: only causal Gemma checkpoints are supported")
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype (55.4256 becomes 55.5 in bf16).
        self.register_buffer(
            "normalizer", torch.tensor(cfg.hidden_size**0.5, dtype=ctx.dtype), persistent=False
        )
        ropes = self.layer_ropes(ctx)
        self.layers = nn.ModuleList(
            [layer_cls(ctx, ropes[i], i, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def layer_ropes(self, ctx: ModelBuildContext) -> list[RotaryEmbedding]:
        """Each layer's RoPE: Gemma 2 has one, shared by every layer (one cos/sin cache)."""
        rope = get_rope(ctx.hf_config, head_dim_of(ctx.hf_config))
        return [rope] * ctx.hf_config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """The CausalLM protocol for Gemma 2 checkpoints (Llama's, with Gemma's backbone and soft-capped logits);
    Gemma 3 swaps the model and decoder-layer classes."""

    decoder_layer_cls: ClassVar[type[nn.Module]] = Gemma2DecoderLayer
    model_cls: ClassVar[Callable[..., nn.Module]] = Gemma2Model
    tie_word_embeddings_default: ClassVar[bool] = True
    derived_buffers: ClassVar[tuple[str, ...]] = _DERIVED_BUFFERS
    supports_pipeline_parallel: ClassVar[bool] = False  # Gemma2Model builds every layer on every rank

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__(ctx)
        cap = getattr(ctx.hf_config, "final_logit_softcapping", None)
        self.final_soft_cap = float(cap) if cap else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits, soft-capped as cap * tanh(logits / cap)."""
        logits = self.lm_head(hidden_states).float()
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
