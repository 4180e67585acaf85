"""Llama 4's text model (transformers' Llama4ForCausalLM): pre-norm decoder layers of two kinds of attention and
two kinds of MLP.

Layer i:  h = x + o_proj(attn(q, k, v))          q, k, v = split(qkv_proj(norm(x)))
          y = h + mlp(norm(h))                   mlp = MoE on config.moe_layers (every interleave_moe_layer_step-th
                                                 layer), the dense SwiGLU of intermediate_size_mlp elsewhere
Attention, by config.no_rope_layers[i] (1 = RoPE):
    RoPE layers   rope(q), rope(k) (GPT-J interleaved pairs), then an L2 norm of each head's q and k
                  (use_qk_norm; no weight); attention within chunks of attention_chunk_size positions
                  (layer_types "chunked_attention"), so their KV group releases earlier chunks' blocks
    NoPE layers   no position encoding and full causal attention; with attn_temperature_tuning each query is
                  scaled by  log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1  (longer context, sharper)
MoE:      logits = router(x) [T, E];  the top k per token;  s = sigmoid(their logits)
          moe(x) = shared_expert(x) + sum_k expert_{id_k}(s_k * x)
          The router's score scales the expert's *input*, not its output (transformers' Llama4TextMoe), so
          each (token, k) pair goes to the fused-MoE op as its own row s_k * x with weight 1.

Checkpoint layout of the experts (transformers' Llama4TextExperts):
    feed_forward.experts.gate_up_proj [E, H, 2I]  gate | up halves on the last axis
    feed_forward.experts.down_proj    [E, I, H]
converted at load to the fused-MoE op's layout: w13 [E, 2I, H], w2 [E, H, I] (transposes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from pagedllm.api import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec
from pagedllm.api.model import (
    STACKED_PARAMS,
    FusedMoE,
    LlamaAttention,
    LlamaMLP,
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
)

_DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def layer_chunk_size(cfg: Any, layer_idx: int) -> int | None:
    """The layer's attention chunk, or None for full attention, as transformers' layer_types decide it."""
    chunk = getattr(cfg, "attention_chunk_size", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not chunk or layer_types is None or layer_types[layer_idx] != "chunked_attention":
        return None
    return int(chunk)


class Llama4Attention(LlamaAttention):
    """LlamaAttention with Llama 4's per-layer choices: RoPE + qk L2 norm + chunked local, or NoPE + full
    attention + temperature tuning (the module docstring)."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        cfg = ctx.hf_config
        bias = bool(getattr(cfg, "attention_bias", False))
        chunk = layer_chunk_size(cfg, layer_idx)
        super().__init__(ctx, rotary, layer_idx, prefix, qkv_bias=bias, o_bias=bias, attention_chunk_size=chunk)
        self.chunk_size = chunk
        self.use_rope = bool(cfg.no_rope_layers[layer_idx])
        self.l2_qk_norm = bool(cfg.use_qk_norm) and self.use_rope
        self.norm_eps = float(cfg.rms_norm_eps)
        self.temperature_tuning = bool(cfg.attn_temperature_tuning) and not self.use_rope
        self.floor_scale = float(cfg.floor_scale)
        self.attn_scale = float(cfg.attn_scale)

    def _l2_norm(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """Each head's vector divided by its root mean square, in float32 (transformers' Llama4TextL2Norm)."""
        t = x.view(x.shape[0], heads, self.head_dim).float()
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return t.to(x.dtype).view_as(x)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
            if self.l2_qk_norm:  # after RoPE, as transformers applies it
                q, k = self._l2_norm(q, self.num_heads), self._l2_norm(k, self.num_kv_heads)
        if self.temperature_tuning:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q.view(q.shape[0], self.num_heads, self.head_dim) * scales[:, None, None]).to(q.dtype)
            q = q.view(q.shape[0], self.q_size)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Llama4MoE(nn.Module):
    """Sigmoid top-k router, experts fed the score-scaled input, plus the shared expert (module docstring)."""

    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.top_k = int(cfg.num_experts_per_tok)
        experts = int(cfg.num_local_experts)
        self.router = ReplicatedLinear(ctx, cfg.hidden_size, experts, bias=False, prefix=f"{prefix}.router")
        self.experts = FusedMoE(ctx, experts, self.top_k, cfg.hidden_size, cfg.intermediate_size,
                                prefix=f"{prefix}.experts")
        self.shared_expert = LlamaMLP(ctx, f"{prefix}.shared_expert")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.router(hidden)
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(values.float()).to(hidden.dtype)  # [T, K]
        num_tokens, size = hidden.shape
        # One row per (token, k) pair, already scaled by its score; the op then weighs each row by 1.
        routed_in = (hidden[:, None, :] * scores[:, :, None]).reshape(num_tokens * self.top_k, size)
        ones = torch.ones(num_tokens * self.top_k, 1, dtype=torch.float32, device=hidden.device)
        routed = self.experts(routed_in, ones, ids.reshape(-1, 1).to(torch.int32))
        routed = routed.view(num_tokens, self.top_k, size).sum(dim=1)
        return cast(torch.Tensor, self.shared_expert(hidden)) + routed


class Llama4DecoderLayer(nn.Module):
    """Pre-norm attention + MoE or dense MLP; returns (hidden, residual) with the last add pending."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = Llama4Attention(ctx, rotary, layer_idx, f"{prefix}.self_attn")
        self.feed_forward: nn.Module
        if layer_idx in cfg.moe_layers:
            self.feed_forward = Llama4MoE(ctx, f"{prefix}.feed_forward")
        else:
            self.feed_forward = LlamaMLP(ctx, f"{prefix}.feed_forward", intermediate_size=cfg.intermediate_size_mlp)
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
        return self.feed_forward(hidden), residual


class Llama4Model(nn.Module):
    """Embedding, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        # transformers rotates (x[2i], x[2i + 1]) pairs as complex numbers: the GPT-J layout.
        rotary = get_rope(cfg, head_dim_of(cfg), is_neox_style=False)
        self.layers = nn.ModuleList(
            [Llama4DecoderLayer(ctx, rotary, i, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
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


def to_fused_moe_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama 4 expert tensors renamed and transposed to FusedMoE's parameters (the module docstring); others
    pass unchanged. Renamed before the stacked mapping, which would read `gate_up_proj` as an `up_proj`."""
    for name, tensor in weights:
        if name.endswith(".feed_forward.experts.gate_up_proj"):
            if tensor.dim() != 3:
                raise WeightLoadError(f"checkpoint tensor '{name}' {tuple(tensor.shape)}: expected [E, H, 2I]")
            yield name.removesuffix("gate_up_proj") + "w13_weight", tensor.transpose(1, 2)
        elif name.endswith(".feed_forward.experts.down_proj"):
            if tensor.dim() != 3:
                raise WeightLoadError(f"checkpoint tensor '{name}' {tuple(tensor.shape)}: expected [E, I, H]")
            yield name.removesuffix("down_proj") + "w2_weight", tensor.transpose(1, 2)
        else:
            yield name, tensor


class Llama4ForCausalLM(nn.Module):
    """The CausalLM protocol for Llama 4 text checkpoints."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        with torch.device(ctx.device):  # build on the target device: no CPU copy of the weights first
            self.model = Llama4Model(ctx)
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
        """One spec per layer: ChunkedLocalAttentionSpec for the chunked (RoPE) layers, FullAttentionSpec for the
        NoPE ones -- two KV-cache groups whenever both kinds are present."""
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            attn = cast(Llama4DecoderLayer, layer).self_attn
            shape = (self.ctx.block_size, attn.num_kv_heads, attn.head_dim, self.ctx.dtype)
            if attn.chunk_size is None:
                specs.append(FullAttentionSpec(*shape))
            else:
                specs.append(ChunkedLocalAttentionSpec(*shape, attention_chunk_size=attn.chunk_size))
        return specs
