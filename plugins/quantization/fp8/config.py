"""FP8 quantization configs: `fp8` checkpoints, on-the-fly `quantization: fp8`, compressed-tensors FP8.

    quant_method fp8        {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
                             "ignored_layers": [...]}: e4m3 `weight`, per-tensor `weight_scale`, and for
                             static activations a per-tensor `input_scale` (vLLM / AutoFP8 checkpoints)
    no quantization_config  `quantization: fp8` in the engine config: float weights are loaded, then each
                             layer is quantized with one scale per output channel; activations dynamic
    compressed-tensors      a float-quantized config group (see compressed_tensors.py): `weight_scale` per
                             tensor [1] or per channel [N, 1]; `input_scale` when activations are static

All three hand out the same Fp8LinearMethod; they differ only in what the checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from pagedllm.api.quantization import is_skipped
from pagedllm.plugins.quantization.fp8 import fp8_reasons
from pagedllm.plugins.quantization.fp8.compressed_tensors import compressed_tensors_reasons
from pagedllm.plugins.quantization.fp8.method import Fp8LinearMethod, Fp8Scheme


def name_matcher(patterns: list[str], field: str) -> Callable[[str], bool]:
    """Exact layer names, or `re:<regex>` (compressed-tensors' convention) matched against the whole name."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"quantization_config.{field} must be a list of layer names (got {patterns!r})")
    exact = {p for p in patterns if not p.startswith("re:")}
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    return lambda name: name in exact or any(r.fullmatch(name) for r in regexes)


class _Fp8ConfigBase:
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, skipped: Callable[[str], bool] = lambda name: False) -> None:
        self.scheme = scheme
        self.skipped = skipped

    def get_method(self, layer: nn.Module, prefix: str) -> Fp8LinearMethod | None:
        if is_skipped(prefix, self.skipped):
            return None  # left dense: the engine's dense method takes the layer
        return Fp8LinearMethod(self.scheme)


class Fp8Config(_Fp8ConfigBase):
    """`quant_method: fp8` checkpoints, or on-the-fly quantization of a float checkpoint."""

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> Fp8Config:
        config = config or {}
        if config.get("quant_method") is None:  # no checkpoint config: quantize on load
            return cls(Fp8Scheme(checkpoint_fp8=False, weight_strategy="channel", activations="dynamic"))
        reasons = fp8_reasons(config)
        if reasons:
            raise ValueError("fp8: " + "; ".join(reasons))
        scheme = Fp8Scheme(True, "tensor", str(config.get("activation_scheme", "dynamic")))
        return cls(scheme, name_matcher(config.get("ignored_layers") or [], "ignored_layers"))


class CompressedTensorsFp8Config(_Fp8ConfigBase):
    """compressed-tensors float-quantized checkpoints (one config group over the Linear layers)."""

    name = "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> CompressedTensorsFp8Config:
        reasons = compressed_tensors_reasons(config)
        if reasons:
            raise ValueError("compressed-tensors: " + "; ".join(reasons))
        assert config is not None
        (group,) = config["config_groups"].values()
        acts = group.get("input_activations")
        # NOTE: dynamic per-tensor activation scales are served per token: each row's own scale is never
        # coarser, and the matmul's scale layout is the same.
        activations = None if acts is None else "dynamic" if acts.get("dynamic") else "static"
        scheme = Fp8Scheme(True, str(group["weights"]["strategy"]), activations)
        return cls(scheme, name_matcher(config.get("ignore") or [], "ignore"))
