"""Model architecture protocol: the nn.Module for an `architectures` name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedllm.kv_cache.spec import KVCacheSpec


@dataclass
class ModelBuildContext:
    """Everything a model class needs to build itself; one frozen bag instead of a growing argument list."""

    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    attn_backend: Any  # an AttentionBackend class
    quant_config: Any | None  # a QuantizationConfig, None for unquantized
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1


class CausalLM(Protocol):
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_metadata: Any,  # the backend's metadata for this step
        kv_caches: list[torch.Tensor],  # one per attention layer, in layer order
    ) -> torch.Tensor:  # [T, hidden_size]
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, in the model's dtype or float32.

        The sampler converts to float32 where the result depends on it (sampling, logprobs, penalties); an
        all-greedy batch takes the argmax of the logits as returned (sampler NOTE 2).
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume HF-named weights; return the names of parameters that were loaded."""
        ...

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer, in the order kv_caches are passed to forward."""
        ...
