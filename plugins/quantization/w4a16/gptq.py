"""Registers the `gptq` method: GPTQ checkpoints (2/4/8-bit, sym or asym, act-order) kept packed.

The check reads only the checkpoint's quantization_config (plain Python, no torch).
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import QuantizationCheckContext, RegisterQuantizationMethod, hookimpl

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def gptq_reasons(qc: QuantizationCheckContext) -> list[str]:
    """Why a quantization_config cannot be served by `gptq` (empty: it can)."""
    if not qc:
        return ["gptq needs a GPTQ checkpoint (config.json has no quantization_config)"]
    method = str(qc.get("quant_method", "")).lower()
    if method != "gptq":
        return [f"the checkpoint is quantized with '{method}', not gptq"]
    reasons = []
    bits = qc.get("bits")
    if bits not in (2, 4, 8):
        reasons.append(f"quantization_config.bits is {bits!r}; supported: 2, 4, 8 (3-bit packing is not)")
    group = qc.get("group_size")
    if not isinstance(group, int) or not (group > 0 or group == -1):
        reasons.append(f"quantization_config.group_size must be a positive integer or -1 (got {group!r})")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in CHECKPOINT_FORMATS:
        reasons.append(f"quantization_config.checkpoint_format is '{fmt}'; supported: {', '.join(CHECKPOINT_FORMATS)}")
    if qc.get("lm_head"):
        reasons.append("quantization_config.lm_head is true; a quantized LM head is not supported")
    if qc.get("dynamic"):
        reasons.append("quantization_config.dynamic (per-module bits) is not supported")
    return reasons


def _load() -> Any:
    from pagedllm.plugins.quantization.w4a16.gptq_config import GPTQConfig

    return GPTQConfig


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register(
        "gptq",
        _load,
        check=gptq_reasons,
        description="GPTQ 2/4/8-bit weights kept packed, act-order via g_idx (CUDA: Triton GEMM; CPU: dequantize)",
    )
