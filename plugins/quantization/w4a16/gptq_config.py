"""The `gptq` quantization config: AutoGPTQ / GPTQModel checkpoints, read from the quantization_config.

    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true,
     "checkpoint_format": "gptq"}

`sym` changes only which zero points the quantizer wrote (2^(bits-1) for every group), so it needs no code
path of its own: the stored qzeros are always read. checkpoint_format "gptq" (v1, AutoGPTQ) stores z - 1,
"gptq_v2" (GPTQModel) stores z.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.plugins.quantization.w4a16.gptq import gptq_reasons
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout
from pagedllm.plugins.quantization.w4a16.method import PackedIntLinearMethod


class GPTQConfig:
    """Hands each linear layer a PackedIntLinearMethod in the GPTQ layout."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, v1: bool) -> None:
        self.layout = PackedLayout("gptq", bits, group_size, zero_offset=1 if v1 else 0)
        self.desc_act = desc_act

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> GPTQConfig:
        """Build from the checkpoint's quantization_config; a ValueError lists every unsupported field."""
        reasons = gptq_reasons(config)
        if reasons:
            raise ValueError("gptq: " + "; ".join(reasons))
        assert config is not None
        v1 = str(config.get("checkpoint_format", "gptq")).lower() == "gptq"
        return cls(int(config["bits"]), int(config["group_size"]), bool(config.get("desc_act", False)), v1)

    def get_method(self, layer: nn.Module, prefix: str) -> PackedIntLinearMethod:
        return PackedIntLinearMethod(self.layout, self.desc_act)
