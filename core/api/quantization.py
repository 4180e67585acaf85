"""pagedllm.api.quantization: What a quantization-method plugin builds on: the unquantized method it falls back to and weight helpers.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.formats.layer_names import is_skipped
from pagedllm.layers.dense import DenseConfig, DenseLinearMethod
from pagedllm.layers.weight_utils import WeightLoadError, set_weight_attrs
from pagedllm.protocols.quantization import (
    CpuFusedOps,
    QuantizationConfig,
    QuantizationMethod,
    RowMatmulMethod,
)

__all__ = [
    "CpuFusedOps",
    "DenseConfig",
    "DenseLinearMethod",
    "QuantizationConfig",
    "QuantizationMethod",
    "RowMatmulMethod",
    "WeightLoadError",
    "is_skipped",
    "set_weight_attrs",
]
