"""Registers the `gguf` method: GGUF weights kept in their quantized blocks, with CPU int4/int8 kernels."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm import hookimpl


class GGUFOptions(BaseModel):
    """`plugins.gguf`: how the kept-quantized method stores what it keeps (validated, so a typo is an error)."""

    model_config = ConfigDict(extra="forbid")

    embedding: Literal["keep", "int4"] = Field(
        "keep", description="the token embedding / tied LM head: its own GGUF blocks, or requantized to int4 "
        "(smaller, lossy)"
    )
    cache_dequantized: bool = Field(
        False, description="types without a fast kernel: keep a float copy after the first call (memory for speed)"
    )


def _load() -> Any:
    from pagedllm.plugins.quantization.gguf_method import GGUFConfig

    return GGUFConfig


@hookimpl
def register_quantization_methods(register: Any) -> None:
    register(
        "gguf",
        _load,
        requires=["gguf"],
        config_model=GGUFOptions,
        description="GGUF blocks kept quantized (CPU: int4 / int8 weight-only GEMMs; others dequantized per call)",
    )
