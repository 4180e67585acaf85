"""The Llama-style decoder blocks most open models reuse: GQA attention with RoPE, and the SwiGLU MLP.

Llama, Qwen2/3, Gemma and hybrid models (Bamba) build their layers from these; a model plugin subclasses a
block to change one piece (`LlamaAttention.qk_norm_rope` is Qwen3's hook) rather than copying it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul, fused_act_down, fused_gate_up_act
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.weight_utils import StackedMapping, WeightLoadError, copy_checked, set_weight_attrs
from pagedllm.protocols.model import ModelBuildContext

# Checkpoint projections that we fuse: (our parameter, checkpoint name, shard id).
STACKED_PARAMS: StackedMapping = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def head_dim_of(cfg: Any) -> int:
    """The explicit head_dim when the config has one (Qwen3, Mistral), else hidden_size / heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """The layer's attention window, or None for full attention, as transformers decides it."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:  # transformers >= 4.53 spells it out per layer
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    # Older Qwen2 configs: a switch plus the number of bottom layers that stay full. Mistral has neither.
    if not getattr(cfg, "use_sliding_window", True) or layer_idx < getattr(cfg, "max_window_layers", 0):
        return None
    return int(window)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: gate and up fused into one column-parallel matmul, down row-parallel."""

    def __init__(self, ctx: ModelBuildContext, prefix: str, intermediate_size: int | None = None) -> None:
        """`intermediate_size` defaults to the config's; Llama 4's dense layers pass intermediate_size_mlp."""
        super().__init__()
        cfg = ctx.hf_config
        if cfg.hidden_act != "silu":
            raise ValueError(f"{prefix}: activation '{cfg.hidden_act}' not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            ctx, cfg.hidden_size, [size, size], bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            ctx, size, cfg.hidden_size, bias=bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused_gate_up_act(self.gate_up_proj, self.act_fn, x)  # e.g. W4A16's GEMV forms it in its epilogue
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        # The down projection may form silu(gate) * up itself (one launch fewer); off unless switched on: the
        # dense GEMV's fold measured slower on the H200 (the unquantized plugin's dense_gemv.py NOTE 3).
        fused = fused_act_down(self.act_fn, self.down_proj, gate_up)
        return fused if fused is not None else self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, paged attention, output projection. `qk_norm_rope` is the Qwen3 hook."""

    def __init__(
        self,
        ctx: ModelBuildContext,
        rotary: RotaryEmbedding,
        layer_idx: int,
        prefix: str,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
        attention_chunk_size: int | None = None,
    ) -> None:
        """`scale` defaults to head_dim ** -0.5; Gemma passes query_pre_attn_scalar ** -0.5 and a soft cap.
        `attention_chunk_size`: the layer attends within chunks of that many positions (Llama 4's local layers).

        `sinks`: a learned sink logit per query head (gpt-oss), the parameter `sinks` ([num_attention_heads]
        in the checkpoint; each rank keeps its heads' entries), added to every softmax's denominator.
        """
        super().__init__()
        cfg = ctx.hf_config
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(
            ctx,
            cfg.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            ctx, total_heads * self.head_dim, cfg.hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj"
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = rotary  # shared by all layers (one cos/sin cache per model)
        self.sliding_window = layer_sliding_window(cfg, layer_idx)
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype), requires_grad=False)
            set_weight_attrs(self.sinks, {"weight_loader": self._load_sinks})
        self.attn = Attention(
            ctx,
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5 if scale is None else scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=self.sinks,
            attention_chunk_size=attention_chunk_size,
            prefix=f"{prefix}.attn",
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """This rank's query heads' sink logits out of the checkpoint's [num_attention_heads]."""
        if shard_id is not None:
            raise WeightLoadError(f"sinks take no shard id (got {shard_id!r})")
        first = self.qkv_proj.tp_rank * self.num_heads
        copy_checked(param.data, loaded[first : first + self.num_heads])

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q and k before RoPE; Llama does nothing."""
        return q, k

    def qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`qk_norm`, then RoPE. A model whose norm and rotation run as one kernel (Qwen3's per-head norms:
        layers/qk_norm.py) overrides this instead of `qk_norm`."""
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm_rope(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))
