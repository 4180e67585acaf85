"""Registers the `fp8` method: FP8 (e4m3) weights with FP8 or 16-bit activations.

Serves checkpoints with `quant_method: fp8` (per-tensor `weight_scale`, static `input_scale` or dynamic
per-token activation scales) and quantizes a float checkpoint on the fly when the config asks for
`quantization: fp8` (per-output-channel weight scales, dynamic per-token activations).
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import QuantizationCheckContext, RegisterQuantizationMethod, hookimpl

ACTIVATION_SCHEMES = ("static", "dynamic")


def fp8_reasons(qc: QuantizationCheckContext) -> list[str]:
    """Why a checkpoint cannot be served by `fp8` (empty: it can). No quantization_config: quantize on load."""
    if not qc:
        return []
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        return [f"the checkpoint is already quantized with '{method}'; fp8 quantizes float checkpoints or reads fp8 ones"]
    reasons = []
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        reasons.append(f"quantization_config.activation_scheme is {scheme!r}; expected one of {ACTIVATION_SCHEMES}")
    if qc.get("weight_block_size"):
        reasons.append("quantization_config.weight_block_size (block-wise FP8 scales) is not supported yet")
    return reasons


def _load() -> Any:
    from pagedllm.plugins.quantization.fp8.config import Fp8Config

    return Fp8Config


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register(
        "fp8",
        _load,
        check=fp8_reasons,
        description="FP8 e4m3 weights (CUDA cc >= 8.9: torch._scaled_mm W8A8; elsewhere dequantize + matmul)",
    )
