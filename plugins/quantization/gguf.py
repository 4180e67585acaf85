"""Registers the `gguf` method: GGUF weights kept in their quantized blocks, with CPU int4/int8 kernels."""

from __future__ import annotations

from typing import Any

from pagedllm import hookimpl


def _load() -> Any:
    from pagedllm.plugins.quantization.gguf_method import GGUFConfig

    return GGUFConfig


@hookimpl
def register_quantization_methods(register: Any) -> None:
    register(
        "gguf",
        _load,
        requires=["gguf"],
        description="GGUF blocks kept quantized (CPU: int4 / int8 weight-only GEMMs; others dequantized per call)",
    )
