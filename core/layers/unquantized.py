"""The default quantization method: dense weights in the model dtype, y = x @ W^T + b."""

from __future__ import annotations

from typing import Any, cast

import torch

from pagedllm.layers.dense_gemv import dense_linear
from pagedllm.layers.gated_gemm import maybe_gated_gemm
from pagedllm.layers.weight_utils import default_weight_loader, set_weight_attrs


class UnquantizedLinearMethod:
    """Stores one dense `weight` [sum(output_partition_sizes), input_size_per_partition] per layer.

    `dense_gemv` (set per layer by dense_gemv.set_dense_gemv, from the engine config) sends decode-sized
    products on CUDA to the Triton GEMV (dense_gemv.py says when); off, every product is F.linear.
    `gated_gemm` (set by gated_gemm.set_gated_gemm, from the engine config) sends a [gate | up] layer's
    prompt-sized products on CUDA to the gated GEMM through `apply_act_and_mul` (gated_gemm.py says when).
    """

    dense_gemv: bool = False
    gated_gemm: bool = False

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
        return dense_linear(x, cast(torch.Tensor, layer.weight), bias, self.dense_gemv)

    def apply_act_and_mul(self, layer: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of this [gate | up] layer from one kernel, or None: the caller runs apply and the
        activation (core/protocols/quantization.py)."""
        if not self.gated_gemm:
            return None
        return maybe_gated_gemm(x, cast(torch.Tensor, layer.weight), cast(torch.Tensor | None, layer.bias), activation)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to repack for dense weights."""


class UnquantizedConfig:
    """The "none" quantization config: every linear layer gets an `UnquantizedLinearMethod`."""

    name = "none"

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> UnquantizedConfig:
        """Build from a checkpoint's quantization_config (ignored: there is nothing to configure)."""
        return cls()

    def get_method(self, layer: torch.nn.Module, prefix: str) -> UnquantizedLinearMethod:
        """The dense method, for any layer."""
        return UnquantizedLinearMethod()
