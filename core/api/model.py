"""pagedllm.api.model: What a model-architecture plugin builds from: the build context and the layers (linear layers with the
quantization hook, norms, rotary, paged attention, the Llama-style decoder blocks, mixture-of-experts routers and
experts), and weight loading.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.distributed.pp_partition import get_pp_indices
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
from pagedllm.layers.moe import FusedMoE, fused_moe, softmax_topk, topk_softmax
from pagedllm.layers.moe_reference import fused_moe_reference
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.pipeline import IntermediateTensors, PPMissingLayer, is_pp_missing, pp_missing_prefixes
from pagedllm.layers.qk_norm import qk_norm_rope
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
from pagedllm.worker.encoder_inputs import EncoderInputs

__all__ = [
    "Attention",
    "EncoderInputs",
    "FusedMoE",
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "IntermediateTensors",
    "LlamaAttention",
    "LlamaMLP",
    "MergedColumnParallelLinear",
    "KernelOptions",
    "ModelBuildContext",
    "PPMissingLayer",
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
    "fused_moe",
    "fused_moe_reference",
    "get_pp_indices",
    "get_rope",
    "head_dim_of",
    "is_pp_missing",
    "layer_sliding_window",
    "load_weights_by_name",
    "pp_missing_prefixes",
    "process_weights_after_loading",
    "qk_norm_rope",
    "set_weight_attrs",
    "softmax_topk",
    "topk_softmax",
]
