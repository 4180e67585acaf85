"""The plain dense method: y = x @ W^T + b with torch's matmul, for layers no quantization method claims.

The engine hands every model a dense method at construction (`ModelBuildContext.dense_config`: the `none`
quantization plugin's, with its decode GEMV and gated GEMM); this one is the fallback for a context built
without one (a model built by hand, tests) and the base class a dense method plugin extends.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from pagedllm.layers.weight_utils import default_weight_loader, set_weight_attrs


class DenseLinearMethod:
    """Stores one dense `weight` [sum(output_partition_sizes), input_size_per_partition] per layer."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register `weight`; output axis 0 and input axis 1 tell the layer's loader where to shard."""
        weight = torch.nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": default_weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W^T (+ bias)."""
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to repack for dense weights."""


class DenseConfig:
    """A dense config: every layer gets a `DenseLinearMethod`."""

    name = "dense"

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> DenseConfig:
        """Nothing to configure."""
        return cls()

    def get_method(self, layer: torch.nn.Module, prefix: str) -> DenseLinearMethod:
        return DenseLinearMethod()
