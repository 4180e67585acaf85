"""Registers the `gguf` method: GGUF weights kept in their quantized blocks, with CPU and CUDA (Triton) kernels."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import RegisterQuantizationMethod, hookimpl


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
    dummy_type: str = Field(
        "Q4_0", description="load_format dummy: the GGUF block type of the random weights (Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q2_K..Q6_K)"
    )
    cpu_kernel: Literal["auto", "native", "aten"] = Field(
        "auto", description="Q4_0/Q4_1/Q8_0 on the CPU: 'native' = our C kernels (built at first use with the "
        "system C compiler; float32 activations), 'aten' = torch's int4/int8 kernels (bfloat16 activations), "
        "'auto' = native where it builds, else aten"
    )


def _load() -> Any:
    from pagedllm.plugins.quantization.gguf.method import GGUFConfig

    return GGUFConfig


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register(
        "gguf",
        _load,
        requires=["gguf"],
        config_model=GGUFOptions,
        description="GGUF blocks kept quantized (CPU: C kernels on the blocks, else int4 / int8 weight-only "
        "GEMMs; CUDA: Triton kernels on the blocks for Q4_0..Q8_0 and Q2_K..Q6_K; other types dequantized per call)",
    )
