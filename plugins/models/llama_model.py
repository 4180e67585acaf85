"""Llama (2/3/3.1, SmolLM2, Mistral): the pre-norm decoder that Qwen2 and Qwen3 reuse piece by piece.

Layer i:  h = x + o_proj(attn(rope(q), rope(k), v))   with q, k, v = split(qkv_proj(norm(x)))
          y = h + down_proj(silu(gate) * up)           with gate, up = split(gate_up_proj(norm(h)))
The residual stream is carried un-normalised next to the hidden state so each RMSNorm fuses the add.
Subclasses change one piece by overriding `LlamaDecoderLayer.build_attention` and naming their decoder layer
class in `decoder_layer_cls`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.layers.activation import SiluAndMul, fused_gate_up_act
from pagedllm.layers.attention import Attention
from pagedllm.layers.dense_gemv import gated_down
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.layers.weight_utils import StackedMapping, load_weights_by_name
from pagedllm.protocols.model import ModelBuildContext

# Checkpoint projections that we fuse: (our parameter, checkpoint name, shard id).
STACKED_PARAMS: StackedMapping = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]
# Buffers some checkpoints carry that we recompute from the config.
_DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def head_dim_of(cfg: Any) -> int:
    """The explicit head_dim when the config has one (Qwen3, Mistral), else hidden_size / heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """The layer's attention window, or None for full attention, as transformers decides it."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:  # transformers >= 4.53 spells it out per layer
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    # Older Qwen2 configs: a switch plus the number of bottom layers that stay full. Mistral has neither.
    if not getattr(cfg, "use_sliding_window", True) or layer_idx < getattr(cfg, "max_window_layers", 0):
        return None
    return int(window)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: gate and up fused into one column-parallel matmul, down row-parallel."""

    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if cfg.hidden_act != "silu":
            raise ValueError(f"{prefix}: activation '{cfg.hidden_act}' not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            ctx, cfg.hidden_size, [size, size], bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            ctx, size, cfg.hidden_size, bias=bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused_gate_up_act(self.gate_up_proj, self.act_fn, x)  # e.g. W4A16's GEMV forms it in its epilogue
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        # The down GEMV may form silu(gate) * up itself (one launch fewer); off unless switched on: it measured
        # slower on the H200 (layers/dense_gemv.py NOTE 3).
        fused = gated_down(self.act_fn, self.down_proj, gate_up)
        return fused if fused is not None else self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, paged attention, output projection. `qk_norm` is the Qwen3 hook."""

    def __init__(
        self,
        ctx: ModelBuildContext,
        rotary: RotaryEmbedding,
        layer_idx: int,
        prefix: str,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """`scale` defaults to head_dim ** -0.5; Gemma passes query_pre_attn_scalar ** -0.5 and a soft cap."""
        super().__init__()
        cfg = ctx.hf_config
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(
            ctx,
            cfg.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            ctx, total_heads * self.head_dim, cfg.hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj"
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = rotary  # shared by all layers (one cos/sin cache per model)
        self.sliding_window = layer_sliding_window(cfg, layer_idx)
        self.attn = Attention(
            ctx,
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5 if scale is None else scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=logits_soft_cap,
            prefix=f"{prefix}.attn",
        )

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q and k before RoPE; Llama does nothing."""
        return q, k

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; returns (hidden, residual) with the last residual add left pending."""

    def __init__(self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = self.build_attention(ctx, rotary, layer_idx, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def build_attention(
        self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> LlamaAttention:
        """The layer's attention block; architectures that differ only here override this."""
        bias = bool(getattr(ctx.hf_config, "attention_bias", False))
        return LlamaAttention(ctx, rotary, layer_idx, prefix, qkv_bias=bias, o_bias=bias)

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


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, ctx: ModelBuildContext, layer_cls: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        rotary = get_rope(cfg, head_dim_of(cfg))
        self.layers = nn.ModuleList(
            [layer_cls(ctx, rotary, i, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if input_ids.shape[0] == 1 and hidden.device.type == "cpu":
            plan = self._cpu_decode_plan()
            out = plan.run(hidden, positions, attn_metadata, kv_caches) if plan is not None else None
            if out is not None:
                return out
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _cpu_decode_plan(self) -> Any:
        """The one-token CPU decode as pre-bound C calls (llama_cpu_decode.py), or None where it does not apply.

        Built on first use after the engine switched the C kernels on, and again if it switches them (NOTE 1
        there); the per-step cost of asking is a dict lookup and an identity check.
        """
        ops = getattr(self.norm, "cpu_ops", None)
        if ops is None:
            return None
        cached = self.__dict__.get("_cpu_plan")
        if cached is None or cached[0] is not ops:
            from pagedllm.plugins.models.llama_cpu_decode import CpuDecodePlan

            cached = (ops, CpuDecodePlan.build(self, (LlamaDecoderLayer, LlamaAttention, LlamaMLP)))
            self.__dict__["_cpu_plan"] = cached
        return cached[1]


class LlamaForCausalLM(nn.Module):
    """The CausalLM protocol for Llama-style checkpoints; subclasses swap `decoder_layer_cls`."""

    decoder_layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    # Gemma reuses this shell with its own backbone, tying default and derived (never loaded) buffers.
    model_cls: ClassVar[Callable[..., nn.Module]] = LlamaModel
    tie_word_embeddings_default: ClassVar[bool] = False
    derived_buffers: ClassVar[tuple[str, ...]] = _DERIVED_BUFFERS

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        # Build straight on the target device: no CPU copy of the weights first.
        with torch.device(ctx.device):
            self.model: Any = self.model_cls(ctx, self.decoder_layer_cls)
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", self.tie_word_embeddings_default))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states (normed, before the LM head)."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype (the sampler makes float32 where it needs it)."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raises WeightLoadError if any parameter (or q/k/v, gate/up shard) is missing."""

        def skip(name: str) -> bool:
            # A tied head is the embedding: a saved lm_head.weight is a duplicate of embed_tokens.
            return any(b in name for b in self.derived_buffers) or (
                self.tie_word_embeddings and name == "lm_head.weight"
            )

        return load_weights_by_name(self, weights, STACKED_PARAMS, skip)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer: SlidingWindowSpec for a windowed layer, FullAttentionSpec otherwise.

        A model mixing both (Qwen2 with max_window_layers below the layer count) gets two KV-cache groups:
        the windowed layers' blocks are released as decoding moves on, the full layers keep theirs.
        """
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            attn = cast(LlamaDecoderLayer, layer).self_attn
            shape = (self.ctx.block_size, attn.num_kv_heads, attn.head_dim, self.ctx.dtype)
            if attn.sliding_window is None:
                specs.append(FullAttentionSpec(*shape))
            else:
                specs.append(SlidingWindowSpec(*shape, sliding_window=attn.sliding_window))
        return specs
