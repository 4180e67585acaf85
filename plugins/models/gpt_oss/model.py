"""gpt-oss (transformers' GptOssForCausalLM): the pre-norm decoder with attention sinks and a MoE MLP.

Layer i:  h = x + o_proj(attn(rope(q), rope(k), v; sinks))     q, k, v = split(qkv_proj(norm(x))), with biases
          y = h + experts(norm(h); topk_softmax(router(norm(h))))
Layers alternate sliding-window and full attention (config.layer_types), so the KV cache has two groups: the
windowed layers' blocks go back to the pool as decoding moves on. Each head's learned sink logit joins its
softmax's denominator (AttentionLayerConfig.sinks); the sinks are logits, not tokens, so no KV block is kept
for them. RoPE is YaRN-scaled (neox halves), and the experts run gpt-oss's clamped SwiGLU ("swigluoai").

Checkpoint layout (bf16 / float checkpoints; MXFP4 ones are refused with the reason):
    mlp.router.weight [E, H], .bias [E]
    mlp.experts.gate_up_proj [E, H, 2I]  gate and up *interleaved* on the last axis (gate = [..., 0::2])
    mlp.experts.gate_up_proj_bias [E, 2I] (interleaved the same way)
    mlp.experts.down_proj [E, I, H], .down_proj_bias [E, H]
are converted at load to the fused-MoE op's layout: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I].
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.api import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.api.model import (
    STACKED_PARAMS,
    FusedMoE,
    LlamaAttention,
    ModelBuildContext,
    ParallelLMHead,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    WeightLoadError,
    get_rope,
    head_dim_of,
    load_weights_by_name,
    topk_softmax,
)

_DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class GptOssMoE(nn.Module):
    """Router (a replicated linear with bias) -> top-k logits -> softmax over those k -> the experts."""

    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.top_k = int(cfg.num_experts_per_tok)
        experts = int(cfg.num_local_experts)
        self.router = ReplicatedLinear(ctx, cfg.hidden_size, experts, bias=True, prefix=f"{prefix}.router")
        self.experts = FusedMoE(
            ctx, experts, self.top_k, cfg.hidden_size, cfg.intermediate_size, bias=True, activation="swigluoai",
            swiglu_limit=float(cfg.swiglu_limit), swiglu_alpha=float(cfg.swiglu_alpha), prefix=f"{prefix}.experts",
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.router(hidden), self.top_k)
        return self.experts(hidden, weights, ids)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm attention (biases, sinks) + MoE block; returns (hidden, residual) with the last add pending."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        bias = bool(getattr(cfg, "attention_bias", True))
        self.self_attn = LlamaAttention(
            ctx, rotary, layer_idx, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias, sinks=True
        )
        self.mlp = GptOssMoE(ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GptOssModel(nn.Module):
    """Embedding, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        rotary = get_rope(cfg, head_dim_of(cfg))  # YaRN from cfg.rope_parameters
        self.layers = nn.ModuleList(
            [GptOssDecoderLayer(ctx, rotary, i, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] as [gate | up]."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def to_fused_moe_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss expert tensors renamed and reshaped to FusedMoE's parameters (the module docstring); others pass."""
    for name, tensor in weights:
        if name.endswith(("_blocks", "_scales")) and ".mlp.experts." in name:
            raise WeightLoadError(
                f"checkpoint tensor '{name}': MXFP4-quantized gpt-oss experts are not supported yet; "
                "use a bf16 checkpoint (e.g. one saved by transformers after dequantizing)"
            )
        if name.endswith(".mlp.experts.gate_up_proj"):
            if tensor.dim() != 3:
                raise WeightLoadError(f"checkpoint tensor '{name}' {tuple(tensor.shape)}: expected [E, H, 2I]")
            yield name.removesuffix("gate_up_proj") + "w13_weight", _deinterleave(tensor).transpose(1, 2)
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            yield name.removesuffix("gate_up_proj_bias") + "w13_bias", _deinterleave(tensor)
        elif name.endswith(".mlp.experts.down_proj"):
            if tensor.dim() != 3:
                raise WeightLoadError(f"checkpoint tensor '{name}' {tuple(tensor.shape)}: expected [E, I, H]")
            yield name.removesuffix("down_proj") + "w2_weight", tensor.transpose(1, 2)
        elif name.endswith(".mlp.experts.down_proj_bias"):
            yield name.removesuffix("down_proj_bias") + "w2_bias", tensor
        else:
            yield name, tensor


class GptOssForCausalLM(nn.Module):
    """The CausalLM protocol for gpt-oss checkpoints."""

    attention_sinks: ClassVar[bool] = True  # the engine then selects a backend that applies them

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        with torch.device(ctx.device):  # build on the target device: no CPU copy of the weights first
            self.model = GptOssModel(ctx)
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states (normed, before the LM head)."""
        return cast(torch.Tensor, self.model(input_ids, positions, attn_metadata, kv_caches))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype."""
        return cast(torch.Tensor, self.lm_head(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (experts converted by `to_fused_moe_layout`); raises WeightLoadError if any
        parameter is missing or mis-shaped."""

        def skip(name: str) -> bool:
            return any(b in name for b in _DERIVED_BUFFERS) or (self.tie_word_embeddings and name == "lm_head.weight")

        return load_weights_by_name(self, to_fused_moe_layout(weights), STACKED_PARAMS, skip)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer: SlidingWindowSpec for the windowed layers, FullAttentionSpec for the others (two
        KV-cache groups). No spec keeps sink tokens: gpt-oss's sinks are per-head logits, not cached tokens."""
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            attn = cast(GptOssDecoderLayer, layer).self_attn
            shape = (self.ctx.block_size, attn.num_kv_heads, attn.head_dim, self.ctx.dtype)
            if attn.sliding_window is None:
                specs.append(FullAttentionSpec(*shape))
            else:
                specs.append(SlidingWindowSpec(*shape, sliding_window=attn.sliding_window))
        return specs
