"""BART (BartForConditionalGeneration): a post-norm encoder-decoder whose decoder cross-attends to the encoder.

    encoder (once per request, in its first step; EncoderInputs):
        h = LN_emb(embed(ids) * s + pos(p + 2));   per layer  h = LN(h + SelfAttn(h));  h = LN(h + FFN(h))
        self-attention over the request's own encoder tokens, bidirectional (torch SDPA, no cache)
    decoder (every step, paged):
        h = LN_emb(embed(ids) * s + pos(p + 2));   per layer  h = LN(h + CausalSelfAttn(h))   KV group: self
                                                             h = LN(h + CrossAttn(h, enc))   KV group: cross
                                                             h = LN(h + FFN(h))
    logits = h @ shared^T + final_logits_bias        (s = sqrt(d_model) with scale_embedding, else 1)

As transformers' modeling_bart: learned positions offset by 2, GELU FFN, every projection with a bias,
queries scaled by head_dim ** -0.5, the LM head tied to the shared embedding.

Cross-attention (NOTE 1): the encoder output's K/V are written once into the request's blocks of the
cross-attention KV-cache group (CrossAttentionSpec; the `cross_attention` KV manager) and read by every
later decoder token. Each cross layer hands the attention backend [decoder queries | zero rows] and [zero
rows | encoder K/V], laid out for the pseudo-batch the runner's cross metadata describes
(pagedllm.api.model.EncoderInputs' module has the drawing), and keeps the first T rows of the output.

NOTE 2: the encoder's bidirectional self-attention runs in torch SDPA one request at a time: the paged
backends attend causally, and the encoder runs once per request, so its cost is one prefill's.
NOTE 3: one tensor-parallel rank only (the projections are replicated); tp > 1 is refused at build.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.api import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec
from pagedllm.api.model import (
    Attention,
    EncoderInputs,
    ModelBuildContext,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    StackedMapping,
    VocabParallelEmbedding,
    WeightLoadError,
    load_weights_by_name,
)

_POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding: position p reads row p + 2
_STACKED: StackedMapping = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]
# The checkpoint's copies of the shared embedding (older checkpoints save them; the tensors are equal).
_TIED_COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"BART: activation_function {name!r} is not supported (have {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class _EmbeddingStack(nn.Module):
    """Token embedding (the shared one, scaled), learned positions, then LayerNorm: the encoder's and the
    decoder's input, with the HF names of their own parameters (embed_positions, layernorm_embedding)."""

    def __init__(self, ctx: ModelBuildContext, shared: VocabParallelEmbedding) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.embed_positions = VocabParallelEmbedding(ctx, cfg.max_position_embeddings + _POSITION_OFFSET, cfg.d_model)
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model, dtype=ctx.dtype)
        self._shared = [shared]  # a list: not a submodule here (the shared embedding is model.shared)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self._shared[0](input_ids) * self.scale + self.embed_positions(positions + _POSITION_OFFSET)
        return self.layernorm_embedding(hidden)  # type: ignore[no-any-return]


class _FFNLayer(nn.Module):
    """A post-norm layer's feed-forward half, with HF's names: final_layer_norm(x + fc2(act(fc1(x))))."""

    def __init__(self, ctx: ModelBuildContext, ffn_dim: int, prefix: str) -> None:
        super().__init__()
        d_model = ctx.hf_config.d_model
        self.fc1 = ReplicatedLinear(ctx, d_model, ffn_dim, bias=True, prefix=f"{prefix}.fc1")
        self.fc2 = ReplicatedLinear(ctx, ffn_dim, d_model, bias=True, prefix=f"{prefix}.fc2")
        self.final_layer_norm = nn.LayerNorm(d_model, dtype=ctx.dtype)
        self.act = _activation(ctx.hf_config.activation_function)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))  # type: ignore[no-any-return]


class BartEncoderAttention(nn.Module):
    """Bidirectional self-attention within each request's encoder tokens (NOTE 2)."""

    def __init__(self, ctx: ModelBuildContext, d_model: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv_proj = QKVParallelLinear(ctx, d_model, self.head_dim, num_heads, num_heads, bias=True,
                                          prefix=f"{prefix}.qkv_proj")
        self.out_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.out_proj")

    def forward(self, hidden: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        out = torch.empty_like(q)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            qh, kh, vh = (t[start:end].view(end - start, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
            seg = F.scaled_dot_product_attention(qh, kh, vh, scale=self.head_dim**-0.5)
            out[start:end] = seg.transpose(0, 1).reshape(end - start, -1)
        return self.out_proj(out)  # type: ignore[no-any-return]


class BartEncoderLayer(_FFNLayer):
    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        cfg = ctx.hf_config
        super().__init__(ctx, cfg.encoder_ffn_dim, prefix)
        self.self_attn = BartEncoderAttention(ctx, cfg.d_model, cfg.encoder_attention_heads, f"{prefix}.self_attn")
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, dtype=ctx.dtype)

    def forward(self, hidden: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, bounds))
        return self.feed_forward(hidden)


class BartDecoderSelfAttention(nn.Module):
    """Causal self-attention over the request's decoder tokens, in the paged cache (the self-attention group)."""

    def __init__(self, ctx: ModelBuildContext, d_model: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv_proj = QKVParallelLinear(ctx, d_model, self.head_dim, num_heads, num_heads, bias=True,
                                          prefix=f"{prefix}.qkv_proj")
        self.out_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.out_proj")
        self.attn = Attention(ctx, num_heads, self.head_dim, num_heads, self.head_dim**-0.5, prefix=f"{prefix}.attn")

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata))  # type: ignore[no-any-return]


class BartCrossAttention(nn.Module):
    """Decoder queries over the request's encoder output, whose K/V sit in the cross-attention group (NOTE 1)."""

    def __init__(self, ctx: ModelBuildContext, d_model: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.q_proj")
        self.k_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.k_proj")
        self.v_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.v_proj")
        self.out_proj = ReplicatedLinear(ctx, d_model, d_model, bias=True, prefix=f"{prefix}.out_proj")
        self.attn = Attention(ctx, num_heads, self.head_dim, num_heads, self.head_dim**-0.5, prefix=f"{prefix}.attn")

    def forward(
        self, hidden: torch.Tensor, encoder_hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        num_decoder, num_encoder = hidden.shape[0], encoder_hidden.shape[0]
        q = self.q_proj(hidden)
        if num_encoder:
            k, v = self.k_proj(encoder_hidden), self.v_proj(encoder_hidden)
            query = torch.cat([q, q.new_zeros(num_encoder, q.shape[1])])
            key = torch.cat([k.new_zeros(num_decoder, k.shape[1]), k])
            value = torch.cat([v.new_zeros(num_decoder, v.shape[1]), v])
        else:  # every request's encoder ran in an earlier step: only the reads remain
            query, key, value = q, torch.zeros_like(q), torch.zeros_like(q)
        out = self.attn(query, key, value, kv_cache, attn_metadata)[:num_decoder]
        return self.out_proj(out)  # type: ignore[no-any-return]


class BartDecoderLayer(_FFNLayer):
    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        cfg = ctx.hf_config
        super().__init__(ctx, cfg.decoder_ffn_dim, prefix)
        heads = cfg.decoder_attention_heads
        # Registration order is the KV layers' order (self, then cross): kv_cache_specs lists them so.
        self.self_attn = BartDecoderSelfAttention(ctx, cfg.d_model, heads, f"{prefix}.self_attn")
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, dtype=ctx.dtype)
        self.encoder_attn = BartCrossAttention(ctx, cfg.d_model, heads, f"{prefix}.encoder_attn")
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model, dtype=ctx.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        encoder_hidden: torch.Tensor,
        self_cache: torch.Tensor,
        cross_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, self_cache, attn_metadata))
        hidden = self.encoder_attn_layer_norm(
            hidden + self.encoder_attn(hidden, encoder_hidden, cross_cache, attn_metadata)
        )
        return self.feed_forward(hidden)


class BartEncoder(_EmbeddingStack):
    def __init__(self, ctx: ModelBuildContext, shared: VocabParallelEmbedding) -> None:
        super().__init__(ctx, shared)
        cfg = ctx.hf_config
        self.layers = nn.ModuleList([BartEncoderLayer(ctx, f"model.encoder.layers.{i}")
                                     for i in range(cfg.encoder_layers)])

    def forward(self, inputs: EncoderInputs) -> torch.Tensor:
        hidden = self.embed(inputs.input_ids, inputs.positions)
        bounds = inputs.query_start_loc_cpu.tolist()
        for layer in self.layers:
            hidden = layer(hidden, bounds)
        return hidden


class BartDecoder(_EmbeddingStack):
    def __init__(self, ctx: ModelBuildContext, shared: VocabParallelEmbedding) -> None:
        super().__init__(ctx, shared)
        cfg = ctx.hf_config
        self.layers = nn.ModuleList([BartDecoderLayer(ctx, f"model.decoder.layers.{i}")
                                     for i in range(cfg.decoder_layers)])


class BartModel(nn.Module):
    """HF prefix `model.`: the shared embedding, the encoder, the decoder."""

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.shared = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.d_model)
        self.encoder = BartEncoder(ctx, self.shared)
        self.decoder = BartDecoder(ctx, self.shared)


class BartForConditionalGeneration(nn.Module):
    """The CausalLM protocol for an encoder-decoder: forward also takes the step's `encoder_inputs`."""

    # The runner passes `encoder_inputs=` and lays out the cross-attention group (worker/encoder_inputs.py).
    is_encoder_decoder: ClassVar[bool] = True

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        if ctx.tp_size > 1 or ctx.pp_size > 1:
            raise ValueError("BART runs on one rank: tensor and pipeline parallelism are not supported (NOTE 3)")
        cfg = ctx.hf_config
        if getattr(cfg, "add_final_layer_norm", False) or getattr(cfg, "normalize_before", False):
            raise ValueError("BART: pre-norm variants (mBART's normalize_before / add_final_layer_norm) are not "
                             "supported; this plugin runs the post-norm BART")
        self.ctx = ctx
        with torch.device(ctx.device):
            self.model = BartModel(ctx)
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.d_model)
            self.final_logits_bias = nn.Parameter(torch.zeros(1, cfg.vocab_size, dtype=ctx.dtype),
                                                  requires_grad=False)
        self.lm_head.tie_weights(self.model.shared)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
        encoder_inputs: EncoderInputs | None = None,
    ) -> torch.Tensor:
        """[T] decoder ids and positions -> [T, d_model]; runs the encoder first on `encoder_inputs`' prompts."""
        if encoder_inputs is None:
            raise ValueError("BartForConditionalGeneration.forward needs encoder_inputs (the model runner lays "
                             "them out for models with is_encoder_decoder)")
        if encoder_inputs.num_decoder_tokens != input_ids.shape[0]:
            raise ValueError(f"encoder_inputs were laid out for {encoder_inputs.num_decoder_tokens} decoder rows, "
                             f"the step has {input_ids.shape[0]}")
        encoder_hidden = (self.model.encoder(encoder_inputs) if encoder_inputs.num_tokens
                          else input_ids.new_empty(0, self.ctx.hf_config.d_model, dtype=self.ctx.dtype))
        decoder = self.model.decoder
        hidden = decoder.embed(input_ids, positions)
        for i, layer in enumerate(decoder.layers):
            hidden = layer(hidden, encoder_hidden, kv_caches[2 * i], kv_caches[2 * i + 1], attn_metadata)
        return hidden  # type: ignore[no-any-return]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) + self.final_logits_bias  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors; the embedding's saved copies are skipped (the LM head is tied to model.shared)."""
        if not getattr(self.ctx.hf_config, "tie_word_embeddings", True):
            raise WeightLoadError("BART with an untied LM head is not supported (tie_word_embeddings is false)")
        return load_weights_by_name(self, weights, _STACKED, lambda name: name in _TIED_COPIES)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per decoder layer: its self-attention (FullAttentionSpec), then its cross-attention (CrossAttentionSpec)."""
        cfg = self.ctx.hf_config
        heads = cfg.decoder_attention_heads
        shape = (self.ctx.block_size, heads, cfg.d_model // heads, self.ctx.dtype)
        self_spec = FullAttentionSpec(*shape)
        cross_spec = CrossAttentionSpec(*shape, max_encoder_len=int(cfg.max_position_embeddings))
        return [spec for _ in range(cfg.decoder_layers) for spec in (self_spec, cross_spec)]
