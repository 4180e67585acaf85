"""Registers the `cpu` attention backend: paged attention in C for bf16 CPU models (backend.py, paged_attention.c)."""

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
    if ctx.dtype != "bfloat16":
        # NOTE: float32 CPU models promise greedy tokens identical to transformers; the C kernel's sums run in
        # another order than torch's, and the context cannot tell a GGUF model kept quantized (which promises
        # no such thing) from a dense one, so float32 stays on `torch`. The kernel itself takes float32.
        reasons.append(f"bfloat16 models only (dtype {ctx.dtype}; float32 stays on the exact torch backend)")
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype):
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (the model dtype only)")
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
    # Above `torch` (0), so a bf16 CPU model picks it; the GPU backends' checks refuse the CPU anyway.
    register("cpu", _load, priority=10, check=_check, description="paged attention in C for bf16 CPU models")
