"""The engine build's attention backend: selected for the model, the device and the KV cache's dtype (builder.py's
second stage), and on the CPU for the dtype `kv_cache.cache_dtype: auto` chose, falling back to the model's when
no backend takes it."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.selector import Selection, SelectionError, select


def select_attention_for_cache(
    config: EngineConfig, pm: PluginManager, hf_config: Any, model_cls: Any, device: torch.device,
    dtype: torch.dtype, dense: bool, kv_cache_dtype: str, reason: str,
) -> tuple[Selection, str, str]:
    """The attention backend for the CPU's KV-cache dtype choice, the dtype kept and why. A dtype `auto` chose
    (not the config) that no backend takes -- e.g. bf16 under a float32 model with the `cpu` backend turned off
    -- falls back to the model's, with the backends' reasons; one the config names is validated strictly."""
    chosen = kv_cache_dtype != config.kv_cache.cache_dtype
    try:
        return select_attention(config, pm, hf_config, model_cls, device, dtype, dense, kv_cache_dtype), \
            kv_cache_dtype, reason
    except SelectionError as exc:
        if not chosen:
            raise
        fallback = config.kv_cache.cache_dtype
        selection = select_attention(config, pm, hf_config, model_cls, device, dtype, dense, fallback)
        return selection, fallback, f"{reason}; but no attention backend takes it ({exc}): the model's dtype"


def select_attention(
    config: EngineConfig, pm: PluginManager, hf_config: Any, model_cls: Any, device: torch.device,
    dtype: torch.dtype, dense: bool, kv_cache_dtype: str,
) -> Selection:
    num_attention_heads = getattr(hf_config, "num_attention_heads", None)
    if num_attention_heads:
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_attention_heads
    else:
        # Attention-free models (Mamba): the backend only builds the step metadata, so ask with a head size
        # every backend supports rather than a meaningless one that would rule out the CUDA-graph backends.
        head_size = 128
    attn_ctx = AttentionSelectionContext(
        device_type=device.type,
        compute_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=kv_cache_dtype,
        head_size=head_size,
        block_size=config.kv_cache.block_size,
        sliding_window=bool(getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)),
        logits_soft_cap=bool(getattr(hf_config, "attn_logit_softcapping", None)),
        # A model class with learned attention sinks says so (CausalLM's optional `attention_sinks`).
        sinks=bool(getattr(model_cls, "attention_sinks", False)),
        # Chunked local attention layers (Llama 4): only backends that mask by chunk may serve them.
        chunked_local=bool(getattr(hf_config, "attention_chunk_size", None)),
        # Decode CUDA graphs will be captured: backends without them rank themselves lower (priority_for).
        cuda_graphs=device.type == "cuda" and not config.enforce_eager,
        # Only a dense model promises its float reference's numerics (AttentionSelectionContext.exact_reference).
        exact_reference=dense,
    )
    return select(pm, PluginKind.ATTENTION, attn_ctx, requested=config.attention.backend)
