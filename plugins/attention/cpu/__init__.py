"""Registers the `cpu` attention backend: paged attention in C for bf16 and quantized float32 CPU models
(backend.py, paged_attention.c)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl

# paged_attention.py's switch, read here without importing it (it imports torch).
_DISABLE_ENV = "PAGEDLLM_CPU_ATTENTION"


def _load() -> Any:
    from pagedllm.plugins.attention.cpu.backend import CpuAttentionBackend

    return CpuAttentionBackend


def _check(ctx: AttentionSelectionContext) -> list[str]:
    reasons = []
    if ctx.device_type != "cpu":
        reasons.append(f"CPU tensors only (device {ctx.device_type})")
    if ctx.dtype == "float32" and ctx.exact_reference:
        # NOTE: a dense float32 CPU model promises greedy tokens identical to transformers, and the C kernel's
        # sums run in another order than torch's, so it stays on `torch`. A quantized one (the default GGUF
        # kept quantized) promises no such thing: its weights already differ from the float model's.
        reasons.append("a dense float32 model stays on the exact torch backend (quantized float32 ones run here)")
    elif ctx.dtype not in ("bfloat16", "float32"):
        reasons.append(f"bfloat16 and float32 only (dtype {ctx.dtype})")
    if ctx.kv_cache_dtype not in ("auto", "bfloat16", "float32"):
        # bf16 and float32 caches under either model dtype (backend.py NOTE 4)
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (bfloat16 or float32)")
    if ctx.sinks:
        reasons.append("no attention sinks")
    if ctx.chunked_local:
        reasons.append("no chunked local attention")
    setting = os.environ.get(_DISABLE_ENV, "1")
    if setting.lower() in ("0", "false", "off", "no"):
        reasons.append(f"{_DISABLE_ENV}={setting}")
    elif not any(name and shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc", "clang")):
        reasons.append("no C compiler found ($CC, cc, gcc, clang) to build its kernel")
    return reasons


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    # Above `torch` (0), so a bf16 or quantized float32 CPU model picks it; the GPU backends refuse the CPU anyway.
    register("cpu", _load, priority=10, check=_check,
             description="paged attention in C for bf16 and quantized float32 CPU models")
