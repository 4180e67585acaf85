"""Registers the `awq` method: AutoAWQ GEMM checkpoints (4-bit, grouped, zero points) kept packed.

The check reads only the checkpoint's quantization_config (plain Python, no torch), so `pagedllm plugins` and
the selector can say why a checkpoint cannot use it.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import QuantizationCheckContext, RegisterQuantizationMethod, hookimpl


def awq_reasons(qc: QuantizationCheckContext) -> list[str]:
    """Why a quantization_config cannot be served by `awq` (empty: it can)."""
    if not qc:
        return ["awq needs an AWQ checkpoint (config.json has no quantization_config)"]
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        return [f"the checkpoint is quantized with '{method}', not awq"]
    reasons = []
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        reasons.append(f"quantization_config.bits is {bits!r}; AWQ GEMM packs 4 bits only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        reasons.append(f"quantization_config.version is '{version}'; only the GEMM layout is supported")
    if not qc.get("zero_point", True):
        reasons.append("quantization_config.zero_point is false; only AWQ with zero points is supported")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        reasons.append(f"quantization_config.group_size must be a positive integer (got {group!r})")
    return reasons


def _load() -> Any:
    from pagedllm.plugins.quantization.w4a16.awq_config import AWQConfig

    return AWQConfig


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register(
        "awq",
        _load,
        check=awq_reasons,
        description="AWQ GEMM 4-bit weights kept packed (CUDA: Triton W4A16 GEMM; CPU: dequantize + matmul)",
    )
