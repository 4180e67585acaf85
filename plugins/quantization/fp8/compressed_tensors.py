"""Registers `compressed-tensors` (llm-compressor's checkpoints) for its float-quantized FP8 schemes.

The name is the checkpoint's `quant_method`. Served: one config group targeting Linear layers, 8-bit float
weights with per-tensor or per-channel scales, activations unquantized, static per-tensor or dynamic
(per-token or per-tensor) 8-bit float. Integer (pack-quantized) and block / group schemes are refused with
the field that says so.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import QuantizationCheckContext, RegisterQuantizationMethod, hookimpl


def _args_reasons(where: str, args: Any, strategies: tuple[str, ...]) -> list[str]:
    if not isinstance(args, dict):
        return [f"{where} must be an object (got {args!r})"]
    reasons = []
    if args.get("num_bits") != 8 or args.get("type") != "float":
        reasons.append(f"{where} is {args.get('num_bits')}-bit {args.get('type')}; only 8-bit float is served")
    if args.get("strategy") not in strategies:
        reasons.append(f"{where}.strategy is {args.get('strategy')!r}; served: {', '.join(strategies)}")
    if args.get("symmetric") is False:
        reasons.append(f"{where}.symmetric is false; only symmetric FP8 is served")
    return reasons


def compressed_tensors_reasons(qc: QuantizationCheckContext) -> list[str]:
    """Why a quantization_config cannot be served by `compressed-tensors` (empty: it can)."""
    if not qc:
        return ["compressed-tensors needs a checkpoint made by it (config.json has no quantization_config)"]
    method = str(qc.get("quant_method", "")).lower()
    if method != "compressed-tensors":
        return [f"the checkpoint is quantized with '{method}', not compressed-tensors"]
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        return [f"quantization_config.config_groups has {len(groups) if isinstance(groups, dict) else '?'} groups; one is served"]
    (name, group), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    reasons = []
    fmt = group.get("format") or qc.get("format")
    if fmt != "float-quantized":
        reasons.append(f"{where}.format is {fmt!r}; only 'float-quantized' is served")
    if "Linear" not in (group.get("targets") or []):
        reasons.append(f"{where}.targets must include 'Linear'")
    reasons += _args_reasons(f"{where}.weights", group.get("weights"), ("tensor", "channel"))
    weights = group.get("weights")
    if isinstance(weights, dict) and weights.get("dynamic"):
        reasons.append(f"{where}.weights.dynamic is true; weights must be stored quantized")
    acts = group.get("input_activations")
    if acts is not None:
        reasons += _args_reasons(f"{where}.input_activations", acts, ("tensor", "token"))
        if isinstance(acts, dict) and acts.get("strategy") == "token" and not acts.get("dynamic"):
            reasons.append(f"{where}.input_activations: static per-token scales cannot exist; expected dynamic")
    if group.get("output_activations") is not None:
        reasons.append(f"{where}.output_activations are not supported")
    if qc.get("kv_cache_scheme") is not None:
        reasons.append("quantization_config.kv_cache_scheme (an FP8 KV cache) is not supported")
    return reasons


def _load() -> Any:
    from pagedllm.plugins.quantization.fp8.config import CompressedTensorsFp8Config

    return CompressedTensorsFp8Config


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register(
        "compressed-tensors",
        _load,
        check=compressed_tensors_reasons,
        description="compressed-tensors float-quantized FP8 checkpoints (the fp8 method's kernels)",
    )
