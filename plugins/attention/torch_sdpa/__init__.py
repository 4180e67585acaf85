"""Registers the `torch` attention backend: the pure-PyTorch reference (CPU and GPU), the oracle for others."""

from __future__ import annotations

from typing import Any

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl


def _load() -> Any:
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend

    return TorchSDPABackend


def _check(ctx: AttentionSelectionContext) -> list[str]:
    # fp8_e4m3: stored through a uint8 view, read back as float32 (torch_sdpa_backend's docstring).
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype, "fp8_e4m3"):
        return [f"kv cache dtype {ctx.kv_cache_dtype} not supported (the model dtype or fp8_e4m3)"]
    return []


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    # Lowest priority: always works, never the fastest where a kernel backend is available.
    register("torch", _load, priority=0, check=_check, description="reference paged attention in PyTorch")
