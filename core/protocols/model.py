"""Model architecture protocol: the nn.Module for an `architectures` name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from pagedllm.kv_cache.spec import KVCacheSpec

FusedMode = Literal["auto", "off", "always"]


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels a model's layers run, fixed when the model is built (one engine's choice: two engines in
    one process may differ). Layers read them at construction (pagedllm.layers.fused_ops says how)."""

    # The fused Triton norm / rotary / activation kernels: "auto" on CUDA tensors, "off" the torch code
    # (config `fused_ops: false`), "always" on CPU tensors too through Triton's interpreter (tests only).
    fused_ops: FusedMode = "auto"
    # The CPU's fused C kernels (add+RMSNorm, rotary, SiLU-and-mul, decode attention; a CpuFusedOps from the
    # quantization method that asks for them), or None: the torch code, bit for bit transformers'.
    cpu_ops: Any = None


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
    kernels: KernelOptions = field(default_factory=KernelOptions)
    # The dense method's config (the `none` quantization plugin's) for every layer the quantization config
    # leaves dense and for a dense LM head; None: pagedllm.layers.dense's plain torch matmul.
    dense_config: Any | None = None
    # Pipeline parallelism: this stage and the stage count, and the configured layer split (None: the default,
    # distributed/pp_partition.py). A model that honours them declares `supports_pipeline_parallel = True`.
    pp_rank: int = 0
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class CausalLM(Protocol):
    """A model class. Optional class attribute: `attention_sinks: bool` (absent: False), true when its attention
    layers pass learned sinks (AttentionLayerConfig.sinks), so the engine selects a backend that applies them."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_metadata: Any,  # the backend's metadata for this step
        kv_caches: list[torch.Tensor],  # one per attention layer, in layer order
    ) -> torch.Tensor:  # [T, hidden_size]
        """The step's final hidden states.

        A model with `supports_pipeline_parallel = True` also takes `intermediate_tensors=` (an
        IntermediateTensors from the previous stage, on every stage but the first) and returns an
        IntermediateTensors on every stage but the last; `kv_caches` are then its own stage's layers' only,
        and `kv_cache_specs` lists those layers alone.
        """
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
