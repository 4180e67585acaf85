"""The `none` method: dense weights in the model dtype, y = x @ W^T + b, with the GPU's faster dense kernels.

    dense_gemv   decode-sized products on CUDA through the Triton GEMV (pagedllm.api.kernels.dense_linear;
                 core/layers/dense_gemv.py says when, a kernel the FP8 method shares); the engine
                 config's `dense_gemv` (PAGEDLLM_DENSE_GEMV), on by default; off: every product is F.linear
    gated_gemm   a [gate | up] layer's prompt-sized products on CUDA through the gated GEMM with the
                 activation in its epilogue (`apply_act_and_mul`; gated_gemm.py says when); config
                 `gated_gemm`, off by default

The engine builds this config for every model (ModelBuildContext.dense_config), so the layers a
quantization method leaves dense and a dense LM head take these kernels too. The switches are fixed when a
layer is built: two engines in one process may differ.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from pagedllm.api.kernels import dense_linear, gated_dense_gemv
from pagedllm.api.quantization import DenseLinearMethod
from pagedllm.plugins.quantization.unquantized.gated_gemm import maybe_gated_gemm


class UnquantizedLinearMethod(DenseLinearMethod):
    """Stores one dense `weight` per layer (DenseLinearMethod); multiplies through the GPU's dense kernels."""

    def __init__(self, dense_gemv: bool = False, gated_gemm: bool = False) -> None:
        self.dense_gemv = dense_gemv
        self.gated_gemm = gated_gemm

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W^T (+ bias)."""
        return dense_linear(x, cast(torch.Tensor, layer.weight), bias, self.dense_gemv)

    def apply_act_and_mul(self, layer: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of this [gate | up] layer from one kernel, or None: the caller runs apply and the
        activation (core/protocols/quantization.py)."""
        if not self.gated_gemm:
            return None
        return maybe_gated_gemm(x, cast(torch.Tensor, layer.weight), cast(torch.Tensor | None, layer.bias), activation)

    def apply_act_then(self, layer: torch.nn.Module, gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
        """This layer's product of act(gate) * up formed on the fly from [gate | up] (one launch fewer), or
        None where the decode GEMV does not take it (dense_gemv.py NOTE 3); this rank's part, before any
        all-reduce."""
        if not self.dense_gemv or activation != "silu":
            return None
        return gated_dense_gemv(gate_up, cast(torch.Tensor, layer.weight))


class UnquantizedConfig:
    """The `none` quantization config: every linear layer gets an `UnquantizedLinearMethod`."""

    name = "none"

    def __init__(self, dense_gemv: bool = False, gated_gemm: bool = False) -> None:
        self.dense_gemv = dense_gemv
        self.gated_gemm = gated_gemm

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> UnquantizedConfig:
        """The engine passes its `dense_gemv` and `gated_gemm` switches; a checkpoint's keys mean nothing here."""
        config = config or {}
        return cls(bool(config.get("dense_gemv", False)), bool(config.get("gated_gemm", False)))

    def get_method(self, layer: torch.nn.Module, prefix: str) -> UnquantizedLinearMethod:
        """The dense method with this engine's switches, for any layer."""
        return UnquantizedLinearMethod(self.dense_gemv, self.gated_gemm)
