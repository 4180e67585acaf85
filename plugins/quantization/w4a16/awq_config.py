"""The `awq` quantization config: AutoAWQ GEMM checkpoints, read from config.json's quantization_config.

    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
     "modules_to_not_convert": ["visual"]}     (AutoAWQ also writes w_bit / q_group_size)

Layers named in `modules_to_not_convert` (substring match, as AutoAWQ does) stay dense.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.api.quantization import is_skipped
from pagedllm.plugins.quantization.w4a16.awq import awq_reasons
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout
from pagedllm.plugins.quantization.w4a16.method import PackedIntLinearMethod


class AWQConfig:
    """Hands each linear layer a PackedIntLinearMethod in the AWQ layout (or dense, when not converted)."""

    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None) -> None:
        self.layout = PackedLayout("awq", 4, group_size)
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> AWQConfig:
        """Build from the checkpoint's quantization_config; a ValueError lists every unsupported field."""
        reasons = awq_reasons(config)
        if reasons:
            raise ValueError("awq: " + "; ".join(reasons))
        assert config is not None
        skip = config.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"awq: quantization_config.modules_to_not_convert must be a list of names (got {skip!r})")
        group = config.get("group_size", config.get("q_group_size"))
        return cls(int(group), skip)  # type: ignore[arg-type]  # awq_reasons checked it is an int

    def get_method(self, layer: nn.Module, prefix: str) -> PackedIntLinearMethod | None:
        if is_skipped(prefix, lambda name: any(s in name for s in self.modules_to_not_convert)):
            return None  # left dense: the engine's dense method takes the layer
        return PackedIntLinearMethod(self.layout)
