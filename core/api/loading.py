"""pagedllm.api.loading: What a loader plugin builds on: the model info it returns, Hugging Face folder reading, and the GGUF blocks
container that GGUF loaders hand to quantization methods.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.formats.gguf_blocks import (
    DENSE_TYPES,
    F16_FIELDS,
    GGUFBlocks,
    Q,
    decode_blocks,
    dequantize_blocks,
    random_blocks,
)
from pagedllm.formats.hf_folder import read_json, read_model_info
from pagedllm.layers.weight_utils import WeightLoadError
from pagedllm.protocols.loader import LoadedModelInfo

__all__ = [
    "DENSE_TYPES",
    "F16_FIELDS",
    "GGUFBlocks",
    "LoadedModelInfo",
    "Q",
    "WeightLoadError",
    "decode_blocks",
    "dequantize_blocks",
    "random_blocks",
    "read_json",
    "read_model_info",
]
