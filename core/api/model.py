"""pagedllm.api.model: What a model-architecture plugin builds from: the build context and the layers (linear layers with the
quantization hook, norms, rotary, paged attention, the Llama-style decoder blocks), and weight loading.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul, fused_act_down, fused_gate_up_act
from pagedllm.layers.attention import Attention
from pagedllm.layers.decoder import (
    STACKED_PARAMS,
    LlamaAttention,
    LlamaMLP,
    head_dim_of,
    layer_sliding_window,
)
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.layers.weight_utils import (
    StackedMapping,
    WeightLoadError,
    copy_checked,
    load_weights_by_name,
    process_weights_after_loading,
    set_weight_attrs,
)
from pagedllm.protocols.model import KernelOptions, ModelBuildContext

__all__ = [
    "Attention",
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "LlamaAttention",
    "LlamaMLP",
    "MergedColumnParallelLinear",
    "KernelOptions",
    "ModelBuildContext",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "STACKED_PARAMS",
    "SiluAndMul",
    "StackedMapping",
    "VocabParallelEmbedding",
    "WeightLoadError",
    "copy_checked",
    "fused_gate_up_act",
    "fused_act_down",
    "get_rope",
    "head_dim_of",
    "layer_sliding_window",
    "load_weights_by_name",
    "process_weights_after_loading",
    "set_weight_attrs",
]
