"""Mamba-1 and Mamba-2 language models: embeddings, pre-norm residual blocks of one mixer each, final norm.

Block i:  h = x + mixer(rms_norm(x))      (no attention, no MLP: the mixer is the whole layer)

The two architectures differ only in the mixer (pagedllm.plugins.models.mamba.mixer / mamba2_mixer). Each mixer keeps
a constant-size state per request in its cache tensor (MambaSpec), so the engine's Mamba KV manager gives a
request one block per layer group whatever its length. Names follow transformers (`backbone.embeddings`,
`backbone.layers.{i}.norm`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f`, `lm_head`).

NOTE: transformers keeps the residual stream in float32 when `residual_in_fp32` (the default); here it stays
in the model dtype. Identical in float32 (the CPU default and the parity tests); in bf16 the sums round
slightly differently.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, TypeAlias, cast

import torch
from torch import nn

from pagedllm.api import KVCacheSpec
from pagedllm.api.model import (
    ModelBuildContext,
    ParallelLMHead,
    RMSNorm,
    VocabParallelEmbedding,
    load_weights_by_name,
)
from pagedllm.plugins.models.mamba.mixer import MambaMixer
from pagedllm.plugins.models.mamba.mixer2 import Mamba2Mixer
from pagedllm.plugins.models.mamba.state import MambaStepInfo

Mixer: TypeAlias = MambaMixer | Mamba2Mixer


class MambaBlock(nn.Module):
    """RMSNorm then the mixer; returns (hidden, residual) with the residual add left to the next norm."""

    def __init__(self, ctx: ModelBuildContext, mixer_cls: type[Mixer], prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ctx.dtype)
        self.mixer: Mixer = mixer_cls(ctx, f"{prefix}.mixer")

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cache: torch.Tensor, step: MambaStepInfo
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden, cache, step), residual


class MambaBackbone(nn.Module):
    """Embeddings, blocks, final norm (HF prefix `backbone.`)."""

    def __init__(self, ctx: ModelBuildContext, mixer_cls: type[Mixer]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embeddings = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [MambaBlock(ctx, mixer_cls, f"backbone.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        # One layout for every layer: all mixers share one KV-cache group, hence one state slot per request.
        first = cast(MambaBlock, self.layers[0])
        step = MambaStepInfo.from_metadata(attn_metadata, first.mixer.kv_group_id)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cache, step)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class MambaForCausalLM(nn.Module):
    """The CausalLM protocol for Mamba-1 checkpoints; Mamba2ForCausalLM swaps `mixer_cls`."""

    mixer_cls: ClassVar[type[Mixer]] = MambaMixer

    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.ctx = ctx
        with torch.device(ctx.device):
            self.backbone = MambaBackbone(ctx, self.mixer_cls)
            self.lm_head = ParallelLMHead(ctx, cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.backbone.embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """[T] ids -> [T, hidden] final hidden states (positions are implicit in the recurrent state)."""
        return self.backbone(input_ids, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype (the sampler makes float32 where it needs it)."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raises WeightLoadError naming any missing or unexpected tensor."""

        def skip(name: str) -> bool:
            return self.tie_word_embeddings and name == "lm_head.weight"

        # Old checkpoints name the embedding `backbone.embedding` (transformers renames it on load too).
        renamed = ((n.replace("backbone.embedding.", "backbone.embeddings."), t) for n, t in weights)
        return load_weights_by_name(self, renamed, [], skip)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One MambaSpec per layer (all equal, so one KV-cache group), in layer order."""
        return [cast(MambaBlock, layer).mixer.spec for layer in self.backbone.layers]


class Mamba2ForCausalLM(MambaForCausalLM):
    """Mamba-2 checkpoints: the same backbone with Mamba2Mixer layers."""

    mixer_cls: ClassVar[type[Mixer]] = Mamba2Mixer
