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

from pagedllm.api import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.api.model import (
    STACKED_PARAMS,
    IntermediateTensors,
    LlamaAttention,
    LlamaMLP,
    ModelBuildContext,
    ParallelLMHead,
    PPMissingLayer,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    get_pp_indices,
    get_rope,
    head_dim_of,
    is_pp_missing,
    load_weights_by_name,
    pp_missing_prefixes,
)

# Buffers some checkpoints carry that we recompute from the config.
_DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


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
    """Embedding, decoder layers, final norm (HF prefix `model.`).

    Pipeline stage `ctx.pp_rank` builds layers [start, end) only (PPMissingLayer elsewhere), the embedding
    on the first stage (and on the last when the LM head is tied to it), the final norm on the last; a stage
    other than the first starts from the previous stage's IntermediateTensors, one other than the last
    returns its own.
    """

    def __init__(self, ctx: ModelBuildContext, layer_cls: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.first, self.last = ctx.is_first_stage, ctx.is_last_stage
        self.hidden_size = int(cfg.hidden_size)
        self.start, self.end = get_pp_indices(cfg.num_hidden_layers, ctx.pp_rank, ctx.pp_size, ctx.pp_layer_partition)
        self.embed_tokens: nn.Module = (VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
                                        if self.first or (self.last and tied) else PPMissingLayer())
        rotary = get_rope(cfg, head_dim_of(cfg))
        self.layers = nn.ModuleList(
            [layer_cls(ctx, rotary, i, f"model.layers.{i}") if self.start <= i < self.end else PPMissingLayer()
             for i in range(cfg.num_hidden_layers)]
        )
        self.norm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype) if self.last else PPMissingLayer()
        self.pipelined = ctx.pp_size > 1

    def stage_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order (all of them without pipeline parallelism)."""
        return list(self.layers[self.start : self.end])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.pipelined:
            return self._forward_stage(positions, input_ids, attn_metadata, kv_caches, intermediate_tensors)
        hidden = self.embed_tokens(input_ids)
        if input_ids.shape[0] == 1 and hidden.device.type == "cpu":
            plan = self._cpu_decode_plan()
            out = plan.run(hidden, positions, attn_metadata, kv_caches) if plan is not None else None
            if out is not None:
                return out  # type: ignore[no-any-return]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # type: ignore[no-any-return]

    def _forward_stage(
        self,
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """One pipeline stage's share of the forward (the class docstring)."""
        residual: torch.Tensor | None
        if self.first:
            hidden, residual = self.embed_tokens(input_ids), None
        elif intermediate is None:
            raise ValueError(f"pipeline stage with layers {self.start}..{self.end - 1} needs the previous "
                             "stage's intermediate_tensors")
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        for layer, kv_cache in zip(self.stage_layers(), kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        assert residual is not None  # every stage holds at least one layer (pp_partition.py)
        if not self.last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # type: ignore[no-any-return]

    def _cpu_decode_plan(self) -> Any:
        """The one-token CPU decode as pre-bound C calls (llama/cpu_decode.py), or None where it does not apply.

        Built on first use after the engine switched the C kernels on, and again if it switches them (NOTE 1
        there); the per-step cost of asking is a dict lookup and an identity check.
        """
        ops = getattr(self.norm, "cpu_ops", None)
        if ops is None:
            return None
        cached = self.__dict__.get("_cpu_plan")
        if cached is None or cached[0] is not ops:
            from pagedllm.plugins.models.llama.cpu_decode import CpuDecodePlan

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
    # LlamaModel builds one pipeline stage's layers (its docstring); a backbone that does not sets this False.
    supports_pipeline_parallel: ClassVar[bool] = True

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        # Build straight on the target device: no CPU copy of the weights first.
        with torch.device(ctx.device):
            self.model: Any = self.model_cls(ctx, self.decoder_layer_cls)
            self.lm_head: nn.Module = (ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size) if ctx.is_last_stage
                                       else PPMissingLayer())
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", self.tie_word_embeddings_default))
        if self.tie_word_embeddings and ctx.is_last_stage:
            cast(ParallelLMHead, self.lm_head).tie_weights(cast(VocabParallelEmbedding, self.model.embed_tokens))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """[T] ids and positions -> [T, hidden] final hidden states (normed, before the LM head); a pipeline
        stage other than the last returns its IntermediateTensors instead (LlamaModel)."""
        if intermediate_tensors is None:
            return self.model(input_ids, positions, attn_metadata, kv_caches)  # type: ignore[no-any-return]
        return self.model(input_ids, positions, attn_metadata, kv_caches, intermediate_tensors)  # type: ignore[no-any-return]

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        """Buffers for a step's input from the previous pipeline stage (and the profiling step's stand-in)."""
        return IntermediateTensors.empty(num_tokens, int(self.ctx.hf_config.hidden_size), self.ctx.dtype,
                                         self.ctx.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype (the sampler makes float32 where it needs it)."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raises WeightLoadError if any parameter (or q/k/v, gate/up shard) is missing."""

        other_stages = pp_missing_prefixes(self)  # another pipeline stage's modules: its tensors are not ours

        def skip(name: str) -> bool:
            # A tied head is the embedding: a saved lm_head.weight is a duplicate of embed_tokens.
            return any(b in name for b in self.derived_buffers) or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ) or is_pp_missing(name, other_stages)

        return load_weights_by_name(self, weights, STACKED_PARAMS, skip)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer: SlidingWindowSpec for a windowed layer, FullAttentionSpec otherwise.

        A model mixing both (Qwen2 with max_window_layers below the layer count) gets two KV-cache groups:
        the windowed layers' blocks are released as decoding moves on, the full layers keep theirs.
        """
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            if isinstance(layer, PPMissingLayer):  # another pipeline stage's layer: its cache is there
                continue
            attn = cast(LlamaDecoderLayer, layer).self_attn
            shape = (self.ctx.block_size, attn.num_kv_heads, attn.head_dim, self.ctx.dtype)
            if attn.sliding_window is None:
                specs.append(FullAttentionSpec(*shape))
            else:
                specs.append(SlidingWindowSpec(*shape, sliding_window=attn.sliding_window))
        return specs
