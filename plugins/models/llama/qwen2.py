"""Qwen2 / Qwen2.5: the Llama decoder with bias on q, k and v (none on o)."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.api.model import LlamaAttention, ModelBuildContext, RotaryEmbedding
from pagedllm.plugins.models.llama.model import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer; only the attention's biases differ."""

    def build_attention(
        self, ctx: ModelBuildContext, rotary: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> LlamaAttention:
        return LlamaAttention(ctx, rotary, layer_idx, prefix, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 checkpoints use Llama's parameter names, so loading and the rest are inherited."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen2DecoderLayer
