"""Bamba (IBM): a hybrid decoder whose layers are Mamba-2 mixers except a few full-attention ones.

Layer i:  h = x + mixer_i(norm(x))        mixer_i = Mamba-2 (`mamba`) or attention (`self_attn`),
          y = h + mlp(norm(h))             as `config.layers_block_type[i]` says
Attention is Llama's (GQA, RoPE on half of each head: partial_rotary_factor 0.5); the MLP is Llama's SwiGLU
under the name `feed_forward`; the Mamba-2 mixer is pagedllm.plugins.models.mamba.mixer2 with Bamba's `mamba_*` sizes.

Why Bamba for the hybrid architecture: of the attention + Mamba models transformers implements, it is the one
whose pieces we already have, unchanged (Mamba-2's mixer is line for line transformers' Mamba2Mixer, the
attention and MLP are Llama's), with a dense MLP and a flat config. Jamba adds mixture-of-experts and
layer norms inside its Mamba-1 mixer; GraniteMoeHybrid adds experts and several scaling multipliers.

KV cache: attention layers get FullAttentionSpec, Mamba layers MambaSpec, so the engine makes (at least) two
KV-cache groups: attention blocks grow with the length, each request holds one state block in the Mamba
group. Every module that reads a cache declares `kv_group_id`; the engine sets it (kv_cache/layout.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from pagedllm.api import FullAttentionSpec, KVCacheSpec
from pagedllm.api.model import (
    STACKED_PARAMS,
    LlamaAttention,
    LlamaMLP,
    ModelBuildContext,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    get_rope,
    head_dim_of,
    load_weights_by_name,
)
from pagedllm.plugins.models.mamba.mixer2 import Mamba2Dims, Mamba2Mixer
from pagedllm.plugins.models.mamba.state import MambaStepInfo

MAMBA, ATTENTION = "mamba", "attention"


def layer_kinds(cfg: Any) -> list[str]:
    """MAMBA or ATTENTION per layer, from `layers_block_type` (or `attn_layer_indices`)."""
    kinds = getattr(cfg, "layers_block_type", None)
    if kinds is None:
        attn = set(getattr(cfg, "attn_layer_indices", None) or [])
        return [ATTENTION if i in attn else MAMBA for i in range(cfg.num_hidden_layers)]
    names = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
    unknown = sorted({k for k in kinds if k not in names})
    if unknown:
        raise ValueError(f"Bamba config: layers_block_type holds unknown layer kinds {unknown}")
    return [names[k] for k in kinds]


def mamba_dims(cfg: Any) -> Mamba2Dims:
    """Bamba's `mamba_*` fields as Mamba-2 layer sizes."""
    inter = int(cfg.mamba_expand * cfg.hidden_size)
    heads = int(cfg.mamba_n_heads)
    head_dim = cfg.mamba_d_head
    head_dim = inter // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inter:
        raise ValueError(f"Bamba config: mamba_n_heads * mamba_d_head = {heads * head_dim}, expected {inter}")
    limit = getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Dims(
        hidden_size=int(cfg.hidden_size), num_heads=heads, head_dim=head_dim, n_groups=int(cfg.mamba_n_groups),
        state_size=int(cfg.mamba_d_state), conv_kernel=int(cfg.mamba_d_conv), chunk_size=int(cfg.mamba_chunk_size),
        use_bias=bool(cfg.mamba_proj_bias), use_conv_bias=bool(cfg.mamba_conv_bias), norm_eps=float(cfg.rms_norm_eps),
        activation=str(cfg.hidden_act), time_step_limit=(float(limit[0]), float(limit[1])),
    )


class BambaDecoderLayer(nn.Module):
    """Norm, mixer (Mamba-2 or attention), norm, MLP; returns (hidden, residual) with the last add pending."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, kind: str, index: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"model.layers.{index}"
        self.kind = kind
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: LlamaAttention | None = None
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(ctx, f"{prefix}.mamba", mamba_dims(cfg))
        else:
            bias = bool(getattr(cfg, "attention_bias", False))
            self.self_attn = LlamaAttention(ctx, rotary, index, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias)
        self.feed_forward = LlamaMLP(ctx, f"{prefix}.feed_forward")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: torch.Tensor,
        attn_metadata: Any,
        mamba_step: MambaStepInfo | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.mamba is not None:
            assert mamba_step is not None
            hidden = self.mamba(hidden, cache, mamba_step)
        else:
            assert self.self_attn is not None
            hidden = self.self_attn(positions, hidden, cache, attn_metadata)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        rotary = get_rope(cfg, head_dim_of(cfg))
        self.layers = nn.ModuleList(
            [BambaDecoderLayer(ctx, rotary, kind, i) for i, kind in enumerate(layer_kinds(cfg))]
        )
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        steps: dict[int, MambaStepInfo] = {}  # one layout per Mamba KV-cache group, built once per step
        for module, cache in zip(self.layers, kv_caches, strict=True):
            layer = cast(BambaDecoderLayer, module)
            step = None
            if layer.mamba is not None:
                gid = layer.mamba.kv_group_id
                if gid not in steps:
                    steps[gid] = MambaStepInfo.from_metadata(attn_metadata, gid)
                step = steps[gid]
            hidden, residual = layer(positions, hidden, residual, cache, attn_metadata, step)
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class BambaForCausalLM(nn.Module):
    """The CausalLM protocol for Bamba checkpoints."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        with torch.device(ctx.device):
            self.model = BambaModel(ctx)
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype (the sampler makes float32 where it needs it)."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q/k/v and gate/up fused as in Llama); raises WeightLoadError on a mismatch."""

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

        return load_weights_by_name(self, weights, STACKED_PARAMS, skip)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per layer: MambaSpec for Mamba-2 layers, FullAttentionSpec for attention layers (layer order)."""
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            assert isinstance(layer, BambaDecoderLayer)
            if layer.mamba is not None:
                specs.append(layer.mamba.spec)
            else:
                assert layer.self_attn is not None
                attn = layer.self_attn
                specs.append(FullAttentionSpec(self.ctx.block_size, attn.num_kv_heads, attn.head_dim, self.ctx.dtype))
        return specs
