"""pagedllm.api.loading: What a loader plugin builds on: the model info it returns, Hugging Face folder reading, and the GGUF blocks
container that GGUF loaders hand to quantization methods.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from pagedllm.formats.model_config import ModelConfig, model_config_from_dict
from pagedllm.layers.weight_utils import WeightLoadError
from pagedllm.protocols.loader import LoadedModelInfo

__all__ = [
    "DENSE_TYPES",
    "F16_FIELDS",
    "GGUFBlocks",
    "LoadedModelInfo",
    "ModelConfig",
    "Q",
    "WeightLoadError",
    "build_model_shard",
    "decode_blocks",
    "dequantize_blocks",
    "model_config_from_dict",
    "random_blocks",
    "read_json",
    "read_model_info",
]

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig


def build_model_shard(config: EngineConfig, pm: Any = None, tp_rank: int = 0) -> tuple[torch.nn.Module, LoadedModelInfo]:
    """One tensor-parallel rank's model, weights loaded, in this process (no KV cache, runner or group): for
    tools that convert checkpoints. The engine's builder does the work; imported on call, so importing this
    module stays as light as the loaders that use it."""
    from pagedllm.engine.builder import build_model_shard as build

    return build(config, pm, tp_rank)
